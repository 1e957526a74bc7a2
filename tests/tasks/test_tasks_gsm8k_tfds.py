"""The tfds GSM8K loader, on a data directory the test prepares with the real builder.

The real `gsm8k` builder runs end to end (generate, shuffle, write TFRecords); only its
download is replaced by files the test writes, so no network is touched. Then `Gsm8kTask`
reads them back through `tfds.load(..., download=False)`, as it would a user's prepared
data_dir. Takes ~15-20 s (TensorFlow start-up and dataset preparation).
"""

import json
import sys
from unittest import mock

import pytest

from a3po_jax.tasks import Gsm8kTask, load_tfds_gsm8k, make_task

SPLITS = ("train", "test", "train_socratic", "test_socratic")


def _records(split, n):
    # Gold answers with thousands commas, like real GSM8K ("#### 1,234").
    return [
        {
            "question": f"[{split}] Tom has {i} apples and buys {1000 * i}. How many now?",
            "answer": f"{i} + {1000 * i} = <<{i}+{1000 * i}={1001 * i}>>{1001 * i}\n"
            f"#### {1001 * i:,}",
        }
        for i in range(1, n + 1)
    ]


@pytest.fixture(scope="module")
def prepared_data_dir(tmp_path_factory):
    tfds = pytest.importorskip(
        "tensorflow_datasets", reason="needs the gsm8k extra: pip install 'a3po_jax[gsm8k]'"
    )

    root = tmp_path_factory.mktemp("gsm8k")
    files = {}
    for split in SPLITS:
        path = root / f"{split}.jsonl"
        path.write_text(
            "".join(json.dumps(r) + "\n" for r in _records(split, 4 if split == "train" else 3))
        )
        files[split] = str(path)

    def local_files(self, urls):  # stands in for the download of the four jsonl URLs
        return {split: files[split] for split in urls}

    data_dir = root / "tfds"
    with mock.patch.object(tfds.download.DownloadManager, "download_and_extract", local_files):
        tfds.builder("gsm8k", data_dir=str(data_dir)).download_and_prepare()
    return str(data_dir)


def test_tfds_gsm8k_task_reads_prepared_data(prepared_data_dir):
    task = make_task("gsm8k", data_dir=prepared_data_dir, download=False)
    assert isinstance(task, Gsm8kTask)
    train, test = task.prompts("train"), task.prompts("test")
    assert len(train) == 4 and len(test) == 3
    expected = {r["question"]: r for r in _records("test", 3)}
    # tfds shuffles records when it prepares a dataset, so compare as sets keyed by question.
    assert {p.messages[-1]["content"].split("\n")[0] for p in test} == set(expected)
    for i, prompt in enumerate(test):
        assert prompt.prompt_id == f"gsm8k/test/{i}"
        record = expected[prompt.messages[-1]["content"].split("\n")[0]]
        assert prompt.metadata["solution"] == record["answer"]
        assert prompt.answer == record["answer"].split("#### ")[1].replace(",", "")
        # Correct with the comma-formatted GSM8K answer, wrong with an off-by-one.
        assert task.score(prompt, record["answer"]) == 1.0
        assert task.score(prompt, f"\\boxed{{{int(prompt.answer) - 1}}}") == 0.0
    # Deterministic order: a second task reads the same ids in the same order.
    again = Gsm8kTask(data_dir=prepared_data_dir, download=False).prompts("test")
    assert [p.messages for p in again] == [p.messages for p in test]


def test_tfds_split_slicing(prepared_data_dir):
    task = Gsm8kTask(data_dir=prepared_data_dir, download=False)
    assert len(task.prompts("train[:2]")) == 2


def test_importing_tasks_does_not_import_tensorflow():
    # Run in a fresh interpreter: this test process has imported TensorFlow already.
    import subprocess

    code = "import a3po_jax.tasks, sys; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_without_the_gsm8k_extra_the_error_says_what_to_install(monkeypatch):
    # An installation without tensorflow-datasets (the base install): `import` finds None.
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    with pytest.raises(ImportError, match=r"pip install 'a3po_jax\[gsm8k\]'"):
        load_tfds_gsm8k("test", download=False)
