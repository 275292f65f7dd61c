"""load_dataset_spec: every format gives the same records; mixtures; errors that say where."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from rlhforge.data.errors import DataError
from rlhforge.data.loading import load_dataset_spec

RECORDS = [
    {"input": "What is 1 + 1?", "output": "2", "score": 1},
    {"input": "Name a colour.", "output": "blue", "score": 0},
    {"input": "Say hi", "output": "hi", "score": 3},
]


def _user(ds):
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in ds]


def _write_all_formats(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(RECORDS)
    paths = {}
    paths["jsonl"] = tmp_path / "d.jsonl"
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    paths["json"] = tmp_path / "d.json"
    paths["json"].write_text(json.dumps(RECORDS, indent=1))
    paths["csv"] = tmp_path / "d.csv"
    ds.to_csv(str(paths["csv"]), index=False)
    paths["parquet"] = tmp_path / "d.parquet"
    ds.to_parquet(str(paths["parquet"]))
    paths["arrow"] = tmp_path / "d.arrow"
    import pyarrow as pa

    with pa.OSFile(str(paths["arrow"]), "wb") as f, pa.ipc.new_file(f, ds.data.table.schema) as w:
        w.write_table(ds.data.table)
    paths["save_to_disk"] = tmp_path / "saved"
    ds.save_to_disk(str(paths["save_to_disk"]))
    paths["dict_to_disk"] = tmp_path / "saved_dict"
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(paths["dict_to_disk"]))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "part-a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS[:2]))
    (folder / "part-b.jsonl").write_text(json.dumps(RECORDS[2]) + "\n")
    paths["folder"] = folder
    return paths


def test_every_format_gives_the_same_records(tmp_path):
    paths = _write_all_formats(tmp_path)
    as_text = [{k: str(v) for k, v in r.items()} for r in RECORDS]
    for kind, path in paths.items():
        ds = load_dataset_spec(str(path))
        # CSV cells are strings, read as written (no type guessing); every other format keeps its types
        assert _user(ds) == (as_text if kind == "csv" else RECORDS), kind
        assert ds["_index"] == ([0, 1, 0] if kind == "folder" else [0, 1, 2]), kind
    assert set(load_dataset_spec(str(paths["jsonl"]))["_source"]) == {str(paths["jsonl"])}
    folder_sources = load_dataset_spec(str(paths["folder"]))["_source"]
    assert folder_sources[0].endswith("part-a.jsonl") and folder_sources[2].endswith("part-b.jsonl")
    # DatasetDict split selection, by argument and by @suffix
    assert len(load_dataset_spec(str(paths["dict_to_disk"]), split="test")) == 1
    test = load_dataset_spec(f"{paths['dict_to_disk']}@test")
    assert len(test) == 1 and test[0]["_source"] == f"{paths['dict_to_disk']}@test"


def test_folder_of_split_files(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps({"x": "a"}) + "\n" + json.dumps({"x": "b"}) + "\n")
    (tmp_path / "test.jsonl").write_text(json.dumps({"x": "c"}) + "\n")
    assert load_dataset_spec(str(tmp_path))["x"] == ["a", "b"]
    assert load_dataset_spec(f"{tmp_path}@test")["x"] == ["c"]
    with pytest.raises(DataError, match="no data files for split 'validation'"):
        load_dataset_spec(f"{tmp_path}@validation")


def test_concatenation_keeps_order_and_max_samples(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"x": f"a{i}"}) + "\n" for i in range(3)))
    b.write_text("".join(json.dumps({"x": f"b{i}", "y": i}) + "\n" for i in range(2)))
    ds = load_dataset_spec(f"{a}, {b}")
    assert ds["x"] == ["a0", "a1", "a2", "b0", "b1"]
    assert ds["y"] == [None, None, None, 0, 1]  # column access: None where a record lacks the key
    assert "y" not in ds[0]  # the record itself keeps exactly its own keys
    assert ds["_index"] == [0, 1, 2, 0, 1]
    assert load_dataset_spec(f"{a},{b}", max_samples=4)["x"] == ["a0", "a1", "a2", "b0"]


def test_mixture_is_deterministic_and_follows_probs(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"x": f"a{i}"}) + "\n" for i in range(2000)))
    b.write_text("".join(json.dumps({"x": f"b{i}"}) + "\n" for i in range(2000)))
    spec = f"{a},{b}"
    first = load_dataset_spec(spec, probs="0.7,0.3", seed=1, max_samples=2000)
    again = load_dataset_spec(spec, probs="0.7,0.3", seed=1, max_samples=2000)
    other = load_dataset_spec(spec, probs="0.7,0.3", seed=2, max_samples=2000)
    assert first["x"] == again["x"]
    assert first["x"] != other["x"]
    assert len(first) == 2000
    counts = Counter(src.rsplit("/", 1)[-1] for src in first["_source"])
    # binomial(2000, 0.7): sd ~ 20.5; allow ~4 sd
    assert abs(counts["a.jsonl"] - 1400) < 85, counts
    # provenance points at the right record
    for row in first.select(range(50)):
        assert row["x"] == f"{row['_source'].rsplit('/', 1)[-1][0]}{row['_index']}"
    # probability 0 leaves a dataset out
    assert load_dataset_spec(spec, probs="1,0")["x"] == [f"a{i}" for i in range(2000)]


def test_mixture_oversamples_until_every_dataset_is_used(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"x": f"a{i}"}) + "\n" for i in range(5)))
    b.write_text("".join(json.dumps({"x": f"b{i}"}) + "\n" for i in range(40)))
    ds = load_dataset_spec(f"{a},{b}", probs="0.5,0.5", seed=0)
    # stopping_strategy="all_exhausted": runs until b's 40 records were all drawn, cycling a
    assert set(ds["x"]) == {f"a{i}" for i in range(5)} | {f"b{i}" for i in range(40)}
    assert len(ds) > 45


@pytest.mark.parametrize(
    "probs, message",
    [
        ("0.5", r"has 1 value\(s\) \(0.5\) but the dataset spec has 2 entries"),
        ("0.5,0.4", r"must sum to 1: 0.5 \+ 0.4 = 0.9"),
        ("1.2,-0.2", r"must be >= 0; got .*b.jsonl=-0.2"),
        ("a,b", "must be a number"),
    ],
)
def test_bad_probs(tmp_path, probs, message):
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"x": name}) + "\n")
    with pytest.raises(DataError, match=message):
        load_dataset_spec(f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}", probs=probs)


def test_file_errors_name_the_file_and_line(tmp_path):
    with pytest.raises(DataError, match=r"not found: .*missing\.jsonl"):
        load_dataset_spec(str(tmp_path / "missing.jsonl"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: file is empty"):
        load_dataset_spec(str(empty))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "a", "output": "b"}\n\n{"input": "c", "output": "d"\n')
    with pytest.raises(DataError, match=r"bad\.jsonl, line 3: malformed JSON line") as err:
        load_dataset_spec(str(bad))
    assert err.value.line == 3 and err.value.source == str(bad)
    notobj = tmp_path / "list.jsonl"
    notobj.write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"list\.jsonl, line 2: expected a JSON object"):
        load_dataset_spec(str(notobj))
    txt = tmp_path / "notes.txt"
    txt.write_text("hello\n")
    with pytest.raises(DataError, match=r"extension '\.txt' is not supported; supported: \.jsonl, \.json, \.csv"):
        load_dataset_spec(str(txt))
    with pytest.raises(DataError, match=r"single file, which has one split"):
        load_dataset_spec(f"{bad}@test")


def test_mixing_files_with_different_value_types_keeps_each_value(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps({"answer": "3"}) + "\n")
    b.write_text(json.dumps({"answer": 3}) + "\n")
    assert load_dataset_spec(f"{a},{b}")["answer"] == ["3", 3]
    mixed = load_dataset_spec(f"{a},{b}", probs="0.5,0.5")
    assert {(type(x).__name__, x) for x in mixed["answer"]} == {("str", "3"), ("int", 3)}


@pytest.mark.parametrize("lengths, probs, seed", [((5, 40), (0.5, 0.5), 0), ((300, 200, 7), (0.2, 0.5, 0.3), 11)])
def test_mixture_order_is_the_one_datasets_interleave_gives(tmp_path, lengths, probs, seed):
    import datasets

    names = []
    for k, n in enumerate(lengths):
        path = tmp_path / f"{k}.jsonl"
        path.write_text("".join(json.dumps({"x": f"{k}-{i}"}) + "\n" for i in range(n)))
        names.append(str(path))
    ours = load_dataset_spec(",".join(names), probs=",".join(map(str, probs)), seed=seed)
    theirs = datasets.interleave_datasets(
        [datasets.Dataset.from_list([{"x": f"{k}-{i}"} for i in range(n)]) for k, n in enumerate(lengths)],
        probabilities=list(probs), seed=seed, stopping_strategy="all_exhausted")
    assert ours["x"] == theirs["x"]


MIXED = ['{"q": "a", "label": "0.50"}', '{"q": "b", "label": 7}', '', '{"q": "c", "label": "true"}',
         '{"q": "d", "label": null}', '{"q": "e", "label": 1e3}', '{"q": "f", "label": true}',
         '{"q": "g", "label": [1, "2"]}', '{"q": "h", "label": {"answer": "01"}}', '{"q": "i"}']
MIXED_VALUES = ["0.50", 7, "true", None, 1000.0, True, [1, "2"], {"answer": "01"}]


def test_values_are_read_exactly_as_written(tmp_path):
    jsonl = tmp_path / "mixed.jsonl"
    jsonl.write_text("\n".join(MIXED) + "\n")
    ds = load_dataset_spec(str(jsonl))
    got = [r["label"] for r in ds if "label" in r]
    assert got == MIXED_VALUES and [type(v) for v in got] == [type(v) for v in MIXED_VALUES]
    assert "label" not in ds[8]  # absent stays absent
    assert ds["_line"] == [1, 2, 4, 5, 6, 7, 8, 9, 10] and ds["_index"] == list(range(9))
    # a JSON list: the same values; each record's line is where it starts
    as_list = tmp_path / "mixed.json"
    as_list.write_text("[\n" + ",\n".join(m for m in MIXED if m) + "\n]\n")
    listed = load_dataset_spec(str(as_list))
    assert _user(listed) == _user(ds) and listed["_line"] == list(range(2, 11))
    # CSV: every cell is the string in the file, "0.50" and "007" included
    csv_path = tmp_path / "mixed.csv"
    csv_path.write_text('q,label\na,0.50\nb,007\n\nc,"x, y"\nd,\n')
    rows = load_dataset_spec(str(csv_path))
    assert rows["label"] == ["0.50", "007", "x, y", ""] and rows["_line"] == [2, 3, 5, 6]


@pytest.mark.parametrize("ext", ["jsonl", "json", "csv"])
def test_a_byte_that_is_not_utf8_names_the_file_line_and_offset(tmp_path, ext):
    head = {"jsonl": b'{"q": "fine"}\n', "json": b'[{"q": "fine"},\n', "csv": b"q\n"}[ext]
    bad = {"jsonl": b'{"q": "caf\xe9"}\n', "json": b'{"q": "caf\xe9"}]\n', "csv": b"caf\xe9\n"}[ext]
    path = tmp_path / f"latin1.{ext}"
    path.write_bytes(head + bad)
    offset = len(head) + bad.index(b"\xe9")
    with pytest.raises(DataError, match=rf"latin1\.{ext}, line 2: is not valid UTF-8: byte 0xe9 at byte offset "
                                        rf"{offset} ") as err:
        load_dataset_spec(str(path))
    assert (err.value.source, err.value.line, err.value.offset) == (str(path), 2, offset)


def test_a_leading_byte_order_mark_is_skipped(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"q": "x"}).encode() + b"\n")
    assert _user(load_dataset_spec(str(path))) == [{"q": "x"}]


def test_malformed_json_lists_and_csv_rows_name_the_line(tmp_path):
    cases = {
        "a.json": ('[{"q": 1},\n {"q": 2}\n {"q": 3}]', r"a\.json, line 3: malformed JSON: expecting ',' or ']'"),
        "b.json": ('[{"q": 1},\n 5]', r"b\.json, line 2, record 1: expected a JSON object per record, got number"),
        "c.json": ('[{"q": 1},\n {"q": }]', r"c\.json, line 2: malformed JSON: Expecting value"),
        "d.csv": ("q,label\na,1\nb,2,3\n", r"d\.csv, line 3: has 3 cells but the header has 2 columns"),
        "e.csv": ("q,q\na,b\n", r"e\.csv, line 1: the header names column\(s\) \['q'\] more than once"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(DataError, match=message):
            load_dataset_spec(str(tmp_path / name))
    single = tmp_path / "one.json"
    single.write_text('{\n  "q": "x"\n}\n')
    assert _user(load_dataset_spec(str(single))) == [{"q": "x"}]


def test_builtin_entries(tmp_path):
    ds = load_dataset_spec("builtin:arithmetic?n=30&seed=3")
    assert len(ds) == 30 and ds[0]["_source"] == "builtin:arithmetic?n=30&seed=3@train"
    test = load_dataset_spec("builtin:arithmetic?n=30@test")
    assert not set(ds["prompt"]) & set(test["prompt"])
    assert load_dataset_spec("builtin:reverse?n=5", split="test")[0]["_source"] == "builtin:reverse?n=5@test"
    with pytest.raises(DataError, match=r"unknown built-in dataset .nope.; available: .*arithmetic.*reverse"):
        load_dataset_spec("builtin:nope")


def test_train_and_eval_from_a_holdout_or_a_file(tmp_path):
    from types import SimpleNamespace

    from rlhforge.data.loading import load_train_and_eval

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input": f"q{i}", "output": f"a{i}"}) + "\n" for i in range(8)))
    d = SimpleNamespace(dataset=str(data), dataset_probs=None, dataset_split="train", max_samples=None)
    held = SimpleNamespace(dataset=None, holdout_ratio=0.25, split="train", max_samples=None)
    train, evals = load_train_and_eval(d, held, seed=0)
    # 8 x 0.25 = 2 held out: the last two records, disjoint from training
    assert train["input"] == [f"q{i}" for i in range(6)] and evals["input"] == ["q6", "q7"]
    none = SimpleNamespace(dataset=None, holdout_ratio=0.0, split="train", max_samples=None)
    assert load_train_and_eval(d, none, seed=0)[1] is None
    other = SimpleNamespace(dataset=str(data), holdout_ratio=0.5, split="train", max_samples=3)
    train, evals = load_train_and_eval(d, other, seed=0)  # an eval file wins over the holdout
    assert len(train) == 8 and evals["input"] == ["q0", "q1", "q2"]
