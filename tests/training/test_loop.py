"""The loop's JSONL writer and its resume behaviour."""

import json

from diloco_eqx.training.loop import JsonlWriter, read_jsonl, write_json


def test_resume_drops_lines_past_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    w = JsonlWriter(path)
    for t in range(1, 8):
        w.write({"step": t, "loss": float(t)})
    w.write({"step": 5, "eval": True, "eval_loss": 1.0})
    w.write({"step": 7, "eval": True, "eval_loss": 0.5})
    w.close()
    w = JsonlWriter(path, keep_through=5)
    w.write({"step": 6, "loss": 60.0})
    w.close()
    rows = read_jsonl(path)
    assert [(r["step"], r.get("eval", False)) for r in rows] == [
        (1, False), (2, False), (3, False), (4, False), (5, False), (5, True), (6, False)]
    assert rows[-1]["loss"] == 60.0


def test_write_json_replaces_whole_file(tmp_path):
    path = tmp_path / "run.json"
    write_json(path, {"status": "running"})
    write_json(path, {"status": "finished", "x": [1, 2]})
    assert json.loads(path.read_text()) == {"status": "finished", "x": [1, 2]}
    assert not (tmp_path / "run.json.tmp").exists()
