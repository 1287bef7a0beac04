"""Adversarial checks of pipeline-parallel images (ImageInputs.as_rows / from_rows, Batch.fields /
from_fields, the pipeline's M-RoPE positions made before the stages) and of LoRA in a vision-language
model's tower (add_lora's tower, load_adapter's `_owner`, merging and exporting tower adapters)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shardforge.models.common.images import ImageInputs
from tests.vision import mixed_image_dataset, tiny_llava, tiny_qwen2_vl, vision_data_config, vision_rows


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl"))


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return tiny_llava(tmp_path_factory.mktemp("llava"))


def _folder(family, qwen_dir, llava_dir) -> Path:
    return {"qwen2_vl": qwen_dir, "llava": llava_dir}[family]


# ---------------------------------------------------------------------------------------------------------
# as_rows / from_rows on made-up images


def _synthetic(counts: list[tuple[int, ...]], features: int = 5, seq: int = 7, mrope: bool = True):
    """Images of rows with `counts[r]` images each (each image's patches: its size), numbered so that a
    wrong slice shows; per-row lists of each row's (pixels, grids)."""
    pixels, grids, per_row, rows = [], [], [], []
    value = 1.0
    for r, sizes in enumerate(counts):
        row_pixels, row_grids = [], []
        for i, n in enumerate(sizes):
            p = torch.arange(value, value + n * features).view(n, features)
            value += n * features
            g = torch.tensor([[1, n, 10 * r + i + 1]])
            row_pixels.append(p)
            row_grids.append(g)
        pixels += row_pixels
        grids += row_grids
        per_row.append(
            (
                torch.cat(row_pixels) if row_pixels else torch.zeros(0, features),
                torch.cat(row_grids) if row_grids else torch.zeros(0, 3, dtype=torch.long),
            )
        )
        rows.append([len(sizes), sum(sizes)])
    b = len(counts)
    positions = torch.arange(3 * b * seq).view(3, b, seq) if mrope else torch.arange(b * seq).view(b, seq)
    images = ImageInputs(
        torch.cat(pixels), torch.cat(grids), positions=positions, rows=torch.tensor(rows, dtype=torch.long)
    )
    return images, per_row, positions


@pytest.mark.parametrize("mrope", [True, False])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_rows_round_trip_gives_each_chunk_exactly_its_images(chunks, mrope):
    """Rows with no image, one, and several of different sizes; cut as torch's pipeline schedule cuts every
    per-row kwarg (tensor_split along dim 0): each chunk gets exactly its rows' images in order, its rows'
    positions, and None where its rows have no image."""
    counts = [(), (3, 5), (), (2,), (), ()]
    images, per_row, positions = _synthetic(counts, mrope=mrope)
    fields = images.as_rows()
    split = {k: torch.tensor_split(v, chunks) for k, v in fields.items()}
    bounds = torch.tensor_split(torch.arange(len(counts)), chunks)
    for c, rows in enumerate(bounds):
        chunk = ImageInputs.from_rows({k: v[c] for k, v in split.items()})
        rows = rows.tolist()
        want_pixels = [per_row[r][0] for r in rows if len(counts[r])]
        if not want_pixels:
            assert chunk is None, rows
            continue
        torch.testing.assert_close(chunk.pixel_values, torch.cat(want_pixels), rtol=0, atol=0)
        torch.testing.assert_close(
            chunk.grid_thw, torch.cat([per_row[r][1] for r in rows if len(counts[r])]), rtol=0, atol=0
        )
        want_positions = positions[:, rows] if mrope else positions[rows]
        torch.testing.assert_close(chunk.positions, want_positions, rtol=0, atol=0)
        assert chunk.rows.tolist() == [[len(counts[r]), sum(counts[r])] for r in rows]


def test_rows_round_trip_survives_batch_to_and_a_second_cut():
    """Batch.to keeps the per-row counts; a chunk's images can be cut into rows again (a stage that holds
    several virtual stages sees its chunk's fields once more)."""
    from shardforge.data.batching import Batch

    counts = [(4,), (), (1, 2), ()]
    images, per_row, _ = _synthetic(counts)
    b, s = len(counts), 7
    batch = Batch(
        torch.zeros(b, s, dtype=torch.long),
        torch.full((b, s), -100),
        torch.arange(s).expand(b, s).clone(),
        None,
        0,
        0,
        images=images,
    ).to(torch.device("cpu"))
    assert batch.images.rows is not None
    fields = batch.fields()
    half = Batch.from_fields(None, {k: v if v is None else v[2:] for k, v in fields.items()})
    again = half.fields()
    last = Batch.from_fields(None, {k: v if v is None else v[:1] for k, v in again.items()})
    torch.testing.assert_close(last.images.pixel_values, per_row[2][0], rtol=0, atol=0)
    torch.testing.assert_close(last.images.grid_thw, per_row[2][1], rtol=0, atol=0)
    assert not any(k.startswith("image_") for k in last.extras)


# ---------------------------------------------------------------------------------------------------------
# real batches: text rows beside image rows, packed, chunks of 2 rows out of 4


def _store(tmp_path: Path, folder: Path):
    info = mixed_image_dataset(tmp_path / "data")
    train = vision_rows(
        vision_data_config(tmp_path, folder, [{"name": "mllm_demo", "dataset_info": str(info)}])
    )
    store = train.examples
    assert store.has_images and len(store) == 7
    assert [store.images(i) is None for i in range(7)] == [False] * 4 + [True] * 3
    return store


# rows of 4: text-only rows (4, 5, 6), a packed row mixing a text document with image ones, a row of two
# images of different sizes (record 1) packed with another image document
ROWS = [[4], [0, 5], [6], [1, 2]]


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_pipeline_chunks_with_text_rows_equal_the_whole_batch(tmp_path, qwen_dir, llava_dir, family):
    """What the pipeline does to a micro-batch of 4 rows (rows without images, packed rows, a row of two
    images of different sizes): positions made once (`parallel.images.placed`), its fields cut into
    chunks of 2 and of 1 row; each chunk holds exactly the images collate gives its rows alone (none for
    text-only chunks) and the model's output on it equals the whole batch's on those rows."""
    from shardforge.data.batching import Batch, collate
    from shardforge.models import load_model
    from shardforge.parallel.images import placed

    folder = _folder(family, qwen_dir, llava_dir)
    store = _store(tmp_path, folder)
    batch = collate(store, ROWS, pad_id=0).to(torch.device("cpu"))
    model = load_model(folder).eval()
    with torch.no_grad():
        whole = model(batch.input_ids, batch.position_ids, batch.doc_ids, images=batch.images)
    staged = placed(model, batch)
    assert staged.images.positions is not None
    fields = staged.fields()
    for size in (2, 1):
        for start in range(0, len(ROWS), size):
            rows = ROWS[start : start + size]
            cut = {k: None if v is None else v[start : start + size] for k, v in fields.items()}
            chunk = Batch.from_fields(batch.input_ids[start : start + size], cut)
            alone = collate(store, rows, pad_id=0).images
            if alone is None:
                assert chunk.images is None, rows
            else:
                torch.testing.assert_close(chunk.images.pixel_values, alone.pixel_values, rtol=0, atol=0)
                torch.testing.assert_close(chunk.images.grid_thw, alone.grid_thw, rtol=0, atol=0)
            with torch.no_grad():
                out = model(chunk.input_ids, chunk.position_ids, chunk.doc_ids, images=chunk.images)
            torch.testing.assert_close(out, whole[start : start + size], rtol=1e-5, atol=1e-5)


def test_later_stage_of_a_text_chunk_needs_no_token_ids(tmp_path, qwen_dir):
    """A later Qwen2-VL stage gets the stream, not token ids: a chunk with images must carry its M-RoPE
    positions (made before the stages), and a chunk of text rows needs none."""
    from shardforge.data.batching import Batch, collate
    from shardforge.models import load_model
    from shardforge.parallel.images import placed

    store = _store(tmp_path, qwen_dir)
    batch = collate(store, ROWS, pad_id=0)
    model = load_model(qwen_dir).eval()
    staged = placed(model, batch)
    fields = staged.fields()
    stream = torch.zeros(2, batch.input_ids.shape[1], model.config.hidden_size)
    for start in (0, 2):
        cut = {k: None if v is None else v[start : start + 2] for k, v in fields.items()}
        chunk = Batch.from_fields(None, cut)
        got = model.rotary_positions(stream, chunk.position_ids, chunk.images)
        whole = staged.images.positions[:, start : start + 2]
        torch.testing.assert_close(got if got.dim() == 3 else got.expand(3, -1, -1), whole, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------
# LoRA in the tower


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, qwen_dir, llava_dir):
    """Per family, a batch of two rows with images (one of them two images of different sizes)."""
    from shardforge.data.batching import collate

    out = {}
    for family in ("qwen2_vl", "llava"):
        store = _store(tmp_path_factory.mktemp(f"data_{family}"), _folder(family, qwen_dir, llava_dir))
        out[family] = collate(store, [[0, 5], [1]], pad_id=0)
    return out


def _logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(batch.input_ids, batch.position_ids, batch.doc_ids, images=batch.images)


def _method(targets="all", freeze_tower=False, **lora):
    from shardforge.config.method_schema import MethodSection

    return MethodSection(
        finetuning="lora", lora={"rank": 4, "targets": targets, **lora}, vision={"freeze_tower": freeze_tower}
    )


def _tower_adapter(tmp_path: Path, folder: Path, method) -> tuple[torch.nn.Module, Path]:
    """A model given `method`'s LoRA (its tower adapted) with adapters as training leaves them (B not zero),
    written as the run hands it back (a PEFT folder: checkpoint/export.py's write_model_folder)."""
    from shardforge.adapters.apply import apply_finetuning
    from shardforge.adapters.lora import LoRALinear, is_adapter_key
    from shardforge.adapters.peft_format import save_adapter
    from shardforge.checkpoint.export import plain_modules
    from shardforge.models import load_model

    model = load_model(folder).eval()
    apply_finetuning(model, method, 0)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.lora_B.copy_(torch.randn(module.lora_B.shape, generator=gen) * 0.3)
    state = model.state_dict()
    adapters = {k: v for k, v in state.items() if is_adapter_key(k)}
    family = model.config.family
    out = save_adapter(
        tmp_path / "adapter", family, adapters, method.lora, str(folder), others=plain_modules(family, state)
    )
    return model, out


def _tower_keys(model) -> set[str]:
    from shardforge.adapters.lora import is_adapter_key

    towers = type(model).TOWERS
    return {k for k in model.state_dict() if is_adapter_key(k) and k.split(".")[0] in towers}


def test_a_text_model_with_an_unfrozen_tower_setting_and_lora_is_unchanged(tmp_path):
    """method.vision.freeze_tower false means nothing to a text model: the same adapters, no error."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardforge.adapters.apply import apply_finetuning
    from shardforge.models import load_model

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "llama", vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=3, head_dim=8,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "llama")
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    trained = {}
    for targets in ("all", ["q_proj"]):
        for frozen in (True, False):
            model = load_model(tmp_path / "llama")
            apply_finetuning(model, _method(targets, freeze_tower=frozen), 0)
            trained[targets == "all", frozen] = (
                sorted(n for n, p in model.named_parameters() if p.requires_grad),
                _logits(model, SimpleNamespace(input_ids=ids, position_ids=None, doc_ids=None, images=None)),
            )
        assert trained[targets == "all", True][0] == trained[targets == "all", False][0]
        torch.testing.assert_close(trained[targets == "all", True][1], trained[targets == "all", False][1])


@pytest.mark.parametrize(
    "family, targets", [("qwen2_vl", "all"), ("llava", "all"), ("llava", ["q_proj", "v_proj"])]
)
def test_what_an_adapted_tower_trains(qwen_dir, llava_dir, family, targets):
    """The tower's targeted linears take adapters (LLaVA's: only the CLIP layers before the feature layer,
    none after it nor in the projector); only adapters train; with freeze_language_model only the tower's
    do."""
    from shardforge.adapters.apply import apply_finetuning
    from shardforge.config.method_schema import MethodSection
    from shardforge.models import load_model

    folder = _folder(family, qwen_dir, llava_dir)
    model = load_model(folder)
    apply_finetuning(model, _method(targets), 0)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained), sorted(trained)
    tower = {n for n in trained if model.config.part_of(n) != "language"}
    assert tower and {model.config.part_of(n) for n in tower} == {"tower"}, sorted(tower)
    if family == "llava":
        assert not any("encoder.layers.1." in n or "multi_modal_projector" in n for n in tower), sorted(tower)
        leaves = {n.split(".")[-2] for n in tower}
        assert leaves == ({"q_proj", "v_proj"} if targets != "all" else
                          {"q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"})  # fmt: skip
    method = MethodSection(**{**_method(targets).model_dump(), "vision": {
        "freeze_tower": False, "freeze_language_model": True}})  # fmt: skip
    model = load_model(folder)
    apply_finetuning(model, method, 0)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == tower


@pytest.mark.parametrize("family, dora", [("qwen2_vl", False), ("qwen2_vl", True), ("llava", False)])
def test_training_resumes_from_an_adapter_with_the_tower_adapted(
    tmp_path, qwen_dir, llava_dir, inputs, family, dora
):
    """model.adapter holding tower adapters: every adapter tensor comes back, and the logits with images
    are the adapted model's."""
    from shardforge.adapters.apply import apply_finetuning
    from shardforge.models import load_model

    folder = _folder(family, qwen_dir, llava_dir)
    method = _method(dora=dora)
    trained, adapter = _tower_adapter(tmp_path, folder, method)
    resumed = load_model(folder)
    apply_finetuning(resumed, method, seed=1, adapter=str(adapter))
    ours, theirs = trained.state_dict(), resumed.state_dict()
    assert _tower_keys(resumed)
    for key in _tower_keys(trained):
        torch.testing.assert_close(theirs[key], ours[key], rtol=0, atol=0)
    torch.testing.assert_close(_logits(resumed, inputs[family]), _logits(trained, inputs[family]))


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_pipeline_ranks_resume_their_parts_of_a_tower_adapter(tmp_path, qwen_dir, llava_dir, family):
    """A pipeline rank prunes the model to its stages before apply_finetuning: the first (tower + layer 0)
    reads the tower's and layer 0's adapters, the last (layer 1 only) layer 1's, none refused."""
    from shardforge.adapters.apply import apply_finetuning
    from shardforge.adapters.lora import is_adapter_key
    from shardforge.adapters.peft_format import _owner
    from shardforge.models import load_model

    folder = _folder(family, qwen_dir, llava_dir)
    method = _method()
    trained, adapter = _tower_adapter(tmp_path, folder, method)
    whole = {k: v for k, v in trained.state_dict().items() if is_adapter_key(k)}
    assert {_owner(k) for k in whole} == {"layers.0", "layers.1", *type(trained).TOWERS} - (
        {"multi_modal_projector"} if family == "llava" else set()
    )
    for layers, first, last in (([0], True, False), ([1], False, True)):
        rank = load_model(folder)
        rank.prune(layers, first=first, last=last)
        apply_finetuning(rank, method, seed=1, adapter=str(adapter))
        got = {k: v for k, v in rank.state_dict().items() if is_adapter_key(k)}
        owners = {"layers.0", *type(trained).TOWERS} if first else {"layers.1"}
        assert got.keys() == {k for k in whole if _owner(k) in owners}
        for key, value in got.items():
            torch.testing.assert_close(value, whole[key], rtol=0, atol=0)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_resuming_a_tower_adapter_with_the_tower_frozen_is_refused(tmp_path, qwen_dir, llava_dir, family):
    """An adapter whose tower is adapted, continued with method.vision.freeze_tower true: the tower's
    adapters have nowhere to go. load_adapter promises an error naming the difference; the tower's adapters
    must not be dropped silently (the model would no longer be the adapter's)."""
    from shardforge.adapters.apply import apply_finetuning
    from shardforge.errors import ConfigError, ModelError
    from shardforge.models import load_model

    folder = _folder(family, qwen_dir, llava_dir)
    _, adapter = _tower_adapter(tmp_path, folder, _method())
    with pytest.raises((ModelError, ConfigError), match=r"visual\.|vision_tower\.|tower"):
        apply_finetuning(load_model(folder), _method(freeze_tower=True), seed=1, adapter=str(adapter))


@pytest.mark.parametrize(
    "family, targets", [("qwen2_vl", "all"), ("llava", "all"), ("llava", ["q_proj", "v_proj"])]
)
def test_an_adapter_with_the_tower_adapted_merges_onto_its_base(
    tmp_path, qwen_dir, llava_dir, inputs, family, targets
):
    """merge_adapter (inference's --adapter, `shardforge export --merge` of an adapter folder, a DPO
    reference given as an adapter): the merged model computes what the adapted one does, its tower's
    adapters included."""
    from shardforge.adapters.merge import merge_adapter
    from shardforge.models import load_model

    folder = _folder(family, qwen_dir, llava_dir)
    trained, adapter = _tower_adapter(tmp_path, folder, _method(targets))
    merged = load_model(folder)
    merge_adapter(merged, adapter)
    base = _logits(load_model(folder), inputs[family])
    expected = _logits(trained, inputs[family])
    assert (expected - base).abs().max() > 1e-3
    torch.testing.assert_close(_logits(merged, inputs[family]), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_a_checkpoint_with_the_tower_adapted_exports_merged(tmp_path, qwen_dir, llava_dir, inputs, family):
    """`shardforge export --merge` of a checkpoint: merged_state folds the tower's adapters too; the HF
    folder written loads back with the adapted model's logits."""
    from shardforge.adapters.peft_format import merged_state
    from shardforge.models import load_model
    from shardforge.models.io import save_model

    folder = _folder(family, qwen_dir, llava_dir)
    trained, _ = _tower_adapter(tmp_path, folder, _method())
    state = merged_state(trained, trained.state_dict())
    assert not any(".lora_" in k for k in state)
    plain = load_model(folder)
    assert state.keys() == plain.state_dict().keys()
    save_model(plain, tmp_path / "merged", state_dict=state)
    expected = _logits(trained, inputs[family])
    torch.testing.assert_close(_logits(load_model(tmp_path / "merged"), inputs[family]), expected,
                               rtol=1e-4, atol=1e-4)  # fmt: skip
