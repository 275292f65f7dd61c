"""Images in data records (rlhforge.data.images): every value kind, placement, token expansion, errors."""

import base64
import io
import json

import numpy as np
import pytest
import torch

from rlhforge.data.errors import DataError
from rlhforge.data.images import collate_vlm, expand_image_tokens, load_image, place_images, record_images
from rlhforge.data.loading import load_dataset_spec
from rlhforge.data.records import RecordRef, record_ref
from tests.vlm_helpers import shape_image


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _same(a, b) -> bool:
    return a.size == b.size and np.array_equal(np.asarray(a), np.asarray(b))


def test_every_kind_of_value_gives_the_same_pixels(tmp_path):
    import datasets

    red, blue = shape_image("red", size=(42, 28), seed=1), shape_image("blue", "circle", size=(28, 56), seed=2)
    (tmp_path / "img").mkdir()
    red.save(tmp_path / "img" / "red.png")
    b64 = base64.b64encode(_png(blue)).decode()
    rows = [{"images": "img/red.png"},  # relative to the dataset file, not the working directory
            {"images": [f"data:image/png;base64,{b64}", b64, str(tmp_path / "img" / "red.png")]}]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = load_dataset_spec(str(data))
    first = record_images(records[0], "images", record_ref(records[0], 0))
    second = record_images(records[1], "images", record_ref(records[1], 1))
    assert len(first) == 1 and _same(first[0], red)
    assert len(second) == 3 and _same(second[0], blue) and _same(second[1], blue) and _same(second[2], red)
    # a datasets Image feature, decoded (PIL) or as {"bytes", "path"}
    ds = datasets.Dataset.from_dict({"images": [[{"bytes": _png(blue), "path": None}]]}).cast_column(
        "images", datasets.Sequence(datasets.Image()))
    decoded = record_images(ds[0], "images", RecordRef("<dataset>", 0))
    assert len(decoded) == 1 and _same(decoded[0], blue)
    raw = ds.cast_column("images", datasets.Sequence(datasets.Image(decode=False)))[0]
    assert _same(record_images(raw, "images", RecordRef("<dataset>", 0))[0], blue)
    # ... and through the dataset loader: a datasets folder and a Parquet file keep the Image feature
    ds.save_to_disk(str(tmp_path / "hfds"))
    ds.to_parquet(str(tmp_path / "d.parquet"))
    for spec in (tmp_path / "hfds", tmp_path / "d.parquet"):
        rec = load_dataset_spec(str(spec))[0]
        assert _same(record_images(rec, "images", record_ref(rec, 0))[0], blue), spec
    assert record_images({"messages": []}, "images", RecordRef("<dataset>", 0)) == []  # text-only record
    assert load_image(red.convert("L"), RecordRef("x", 0), "images").mode == "RGB"


def test_errors_name_the_file_record_and_image(tmp_path):
    (tmp_path / "bad.png").write_bytes(b"not a png at all")
    shape_image("red").save(tmp_path / "ok.png")
    rows = [{"images": ["ok.png", "missing.png"]}, {"images": ["ok.png", "bad.png"]},
            {"images": "https://example.com/cat.png"}, {"images": ["ok.png"] * 3}, {"images": [5]}]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = load_dataset_spec(str(data))

    def error(i, max_images=0):
        with pytest.raises(DataError) as info:
            record_images(records[i], "images", record_ref(records[i], i), max_images)
        return str(info.value)

    assert error(0).startswith(f"{data}, record 0, field 'images[1]': image file not found: {tmp_path / 'missing.png'}")
    assert error(1).startswith(f"{data}, record 1, field 'images[1]': unreadable image ({tmp_path / 'bad.png'})")
    assert error(2).startswith(f"{data}, record 2, field 'images[0]': image URLs are not downloaded")
    assert error(3, max_images=2).startswith(
        f"{data}, record 3, field 'images': has 3 images, more than --data.max_images_per_prompt 2")
    assert len(record_images(records[3], "images", record_ref(records[3], 3), 3)) == 3  # at the bound: fine
    assert error(4).startswith(f"{data}, record 4, field 'images[0]': expected an image path, base64 string")


def test_placement_rule():
    ref = RecordRef("d.jsonl", 7)
    # 1. image parts stay where they are
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]},
             {"role": "assistant", "content": "b"}]
    assert place_images(parts, 1, ref, "messages") == parts
    # 2. <image> placeholders become parts, in order
    placed = place_images([{"role": "user", "content": "x<image>y<image>"}], 2, ref, "messages")
    assert placed[0]["content"] == [{"type": "text", "text": "x"}, {"type": "image"}, {"type": "text", "text": "y"},
                                    {"type": "image"}]
    # 3. no placeholder: at the start of the first user message
    convo = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    placed = place_images(convo, 2, ref, "messages")
    assert placed[1]["content"] == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "q"}]
    assert convo[1]["content"] == "q"  # the input is not modified
    assert place_images(convo, 0, ref, "messages") == convo
    with pytest.raises(DataError, match=r"d.jsonl, record 7, field 'messages': the messages have 1 <image> "
                                        r"placeholders but the record has 2 images"):
        place_images([{"role": "user", "content": "<image>?"}], 2, ref, "messages")
    with pytest.raises(DataError, match="the messages have 1 image parts but the record has 0 images"):
        place_images(parts, 0, ref, "messages")


def test_image_token_expansion_and_collation():
    ids, mask = [5, 9, 6, 9, 7], [0, 0, 0, 0, 1]
    assert expand_image_tokens(ids, mask, 9, [2, 3]) == ([5, 9, 9, 6, 9, 9, 9, 7], [0, 0, 0, 0, 0, 0, 0, 1])
    with pytest.raises(ValueError, match="2 image tokens for 1 images"):
        expand_image_tokens(ids, mask, 9, [2])

    class S:
        def __init__(self, ids, pixels, grid):
            self.input_ids, self.loss_mask = ids, [0] + [1] * (len(ids) - 1)
            self.pixel_values, self.image_grid_thw = pixels, grid

    a = S([1, 9, 2], torch.ones(4, 3), torch.tensor([[1, 2, 2]]))
    text_only = S([1, 2], None, None)
    b = S([9, 9, 3, 4], torch.full((8, 3), 2.0), torch.tensor([[1, 2, 2], [1, 2, 2]]))
    batch = collate_vlm([a, text_only, b], pad_id=0, image_token_id=9)
    assert batch["input_ids"].tolist() == [[1, 9, 2, 0], [1, 2, 0, 0], [9, 9, 3, 4]]
    assert torch.equal(batch["pixel_values"], torch.cat([torch.ones(4, 3), torch.full((8, 3), 2.0)]))
    assert batch["image_grid_thw"].tolist() == [[1, 2, 2]] * 3
    assert batch["mm_token_type_ids"].tolist() == [[0, 1, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]]
    assert "pixel_values" not in collate_vlm([text_only], pad_id=0, image_token_id=9)
