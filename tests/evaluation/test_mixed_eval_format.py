"""An eval file of another format than the train file, in one directory (`--dataset_name DIR`): `datasets` loads a
directory's files with one set of columns and fails to cast a conversational eval file to a prompt-completion train
file's, in a traceback naming neither file (`DatasetGenerationError`). It is one line naming each file's columns and
the fix, exit 2, before anything loads or is written."""

import json

from test_reward_faults import RUN, run, snapshot


def test_an_eval_file_of_another_format_beside_the_train_file_is_one_line(tiny_pair, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    with open(data / "train.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": "one " * (1 + i % 4) + "count:", "completion": f" {1 + i % 4}",
                                "answer": str(1 + i % 4)}) + "\n")
    with open(data / "test.jsonl", "w") as f:
        for i in range(4):
            f.write(json.dumps({"messages": [{"role": "user", "content": "one " * (1 + i) + "count:"},
                                             {"role": "assistant", "content": str(1 + i)}],
                                "answer": str(1 + i)}) + "\n")
    before = snapshot(data)
    out = tmp_path / "out"
    code, errors, err = run(["--model_name_or_path", tiny_pair["student"], "--teacher_model_name_or_path",
                             tiny_pair["teacher"], "--dataset_name", str(data), "--output_dir", str(out), *RUN,
                             "--eval_strategy", "steps", "--eval_steps", "1", "--eval_reward_funcs", "exact_match"],
                            capsys)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert errors == [f"trl-distill: error: The data files of --dataset_name {data} have different columns ("
                      "train.jsonl: answer, completion, prompt; test.jsonl: answer, messages), and datasets loads a "
                      "directory's files with one set of columns: write every file in one format (prompt-completion: "
                      "prompt, completion; conversational: messages), the same columns in each."]
    assert snapshot(data) == before and not out.exists()
