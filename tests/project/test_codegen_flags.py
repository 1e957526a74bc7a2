"""The tests' cheaper code generation (helpers/codegen.py): a flag is used only where this
jaxlib accepts it, since an unknown `XLA_FLAGS` entry aborts every process that loads JAX."""

from helpers import codegen


def test_an_unknown_flag_is_refused_and_the_base_flags_accepted():
    assert not codegen.accepts("--xla_cpu_no_such_flag_a3po=true")
    assert codegen.accepts(codegen.BASE)


def test_each_answer_is_remembered_per_jaxlib_version(tmp_path, monkeypatch):
    monkeypatch.setattr(codegen, "CACHE", tmp_path)
    tried = []
    monkeypatch.setattr(codegen, "accepts", lambda flag: tried.append(flag) or False)
    assert codegen.cheap_codegen() == codegen.BASE
    assert codegen.cheap_codegen() == codegen.BASE
    assert tried == list(codegen.OPTIONAL)  # each probed once
    remembered = {p.name.split("-")[2]: p for p in tmp_path.iterdir()}
    assert sorted(remembered) == ["codegen", "fusion"]
    remembered["codegen"].write_text("yes")
    assert codegen.cheap_codegen() == f"{codegen.BASE} {codegen.ONE_CODEGEN_PART}"
    remembered["fusion"].write_text("yes")
    assert codegen.cheap_codegen() == (
        f"{codegen.BASE} {codegen.NO_FUSION_EMITTERS} {codegen.ONE_CODEGEN_PART}"
    )


def test_the_suite_compiles_with_each_flag_this_jaxlib_accepts():
    for flag in codegen.OPTIONAL:
        assert (flag in codegen.CHEAP_CODEGEN.split()) == codegen.accepts(flag), flag
