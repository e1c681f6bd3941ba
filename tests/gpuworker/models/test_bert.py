"""The BERT encoder against transformers' BertModel with sentence-transformers' head (mean pooling,
then normalise) on the real all-MiniLM-L6-v2, and the engine's packed passes."""

import asyncio
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, BertModel

from gpuworker.engine.embedding_engine import CheckedIds, EmbeddingEngine, passes
from gpuworker.models.bert import PackedBatch, SentenceHead, load_bert_encoder

SENTENCES = [
    "What is the capital of France?",
    "a",
    "Embeddings map text to vectors; " * 12,
    "The quick brown fox jumps over the lazy dog.",
    "GPU inference, self-hosted.",
]


def _reference(model_dir, sentences) -> torch.Tensor:
    """What sentence-transformers computes for this model: BertModel, mean over real tokens, unit length."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = tokenizer(sentences, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = BertModel.from_pretrained(model_dir).eval()(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def test_vectors_equal_sentence_transformers_within_1e_5_cosine(minilm_checkpoint):
    reference = _reference(minilm_checkpoint, SENTENCES)
    engine = EmbeddingEngine(minilm_checkpoint)
    try:
        vectors = asyncio.run(engine.embed(engine.tokenize(SENTENCES)))  # ragged: several buckets
    finally:
        engine.shutdown()
    got = torch.stack(vectors)
    assert got.shape == (len(SENTENCES), 384)
    distance = 1 - (got * reference).sum(-1)
    assert distance.abs().max().item() < 1e-5, distance
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-5)


def test_pooling_and_normalisation_come_from_the_sentence_transformers_config(minilm_checkpoint, tmp_path):
    head = SentenceHead.read(minilm_checkpoint)
    assert (head.pooling, head.normalize, head.max_seq_length) == ("mean_tokens", True, 256)
    # The same weights configured for CLS pooling without Normalize give the raw first hidden state.
    model = load_bert_encoder(_with_pooling(minilm_checkpoint, tmp_path, "cls_token"))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    batch = tokenizer(SENTENCES[:2], padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = BertModel.from_pretrained(tmp_path).eval()(**batch).last_hidden_state[:, 0]
    packed = PackedBatch.build(tokenizer(SENTENCES[:2])["input_ids"], "cpu")
    torch.testing.assert_close(model(packed), expected, atol=1e-5, rtol=1e-4)


def _with_pooling(model_dir, tmp_path, mode: str):
    """A copy (by links) of model_dir whose sentence-transformers head pools by `mode`, unnormalised."""
    for item in model_dir.iterdir():
        (tmp_path / item.name).symlink_to(item)
    (tmp_path / "1_Pooling").unlink()
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": 384,
                **{
                    f"pooling_mode_{m}": m == mode
                    for m in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens")
                },
            }
        )
    )
    (tmp_path / "modules.json").unlink()
    modules = json.loads((model_dir / "modules.json").read_text())[:2]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    return tmp_path


def test_unsupported_checkpoints_are_refused_clearly(minilm_checkpoint, tmp_path):
    for item in minilm_checkpoint.iterdir():
        (tmp_path / item.name).symlink_to(item)
    config = json.loads((minilm_checkpoint / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**config, "position_embedding_type": "relative_key"}))
    with pytest.raises(ValueError, match="position_embedding_type"):
        load_bert_encoder(tmp_path)


def test_passes_keep_the_order_within_the_token_budget():
    lengths = [3, 100, 4, 120, 5, 6, 90, 300, 1]
    groups = passes(lengths, max_batch_tokens=250)
    assert [list(g) for g in groups] == [[0, 1, 2, 3, 4, 5], [6], [7], [8]]  # 238 tokens; 300 go alone
    assert passes([], 250) == []


def test_too_long_or_bad_token_ids_are_value_errors(minilm_checkpoint):
    engine = EmbeddingEngine(minilm_checkpoint)
    try:
        with pytest.raises(ValueError, match="at most 256"):
            engine.check([[101] * 257])
        with pytest.raises(ValueError, match="outside"):
            engine.check([[101, 10**6]])
    finally:
        engine.shutdown()


def test_ids_are_checked_once_and_unchecked_ids_still_are(minilm_checkpoint):
    # The replica tokenizes (or checks a request's ids) off the event loop; embed then takes the
    # CheckedIds as they are, instead of scanning every input again on the loop.
    engine = EmbeddingEngine(minilm_checkpoint)
    try:
        ids = engine.tokenize(["hello world"])
        assert isinstance(ids, CheckedIds) and engine.check(ids) is ids
        assert len(asyncio.run(engine.embed(ids))) == 1
        with pytest.raises(ValueError, match="outside"):
            asyncio.run(engine.embed([[101, 10**6]]))
    finally:
        engine.shutdown()


def test_a_packed_batch_addresses_each_token_of_each_input(minilm_checkpoint):
    batch = PackedBatch.build([[101, 7592, 102], [101] + [2088] * 9 + [102], [5]], "cpu")
    assert batch.input_ids.tolist() == [101, 7592, 102, 101, *[2088] * 9, 102, 5]
    assert batch.positions.tolist() == [0, 1, 2, *range(11), 0]
    assert batch.seq_index.tolist() == [0, 0, 0, *[1] * 11, 2]
    assert batch.cu_seqlens.tolist() == [0, 3, 14, 15] and batch.cu_seqlens.dtype == torch.int32
    assert batch.lengths.tolist() == [3, 11, 1] and batch.max_seqlen == 11


@pytest.mark.parametrize("pooling", ["mean_tokens", "cls_token", "max_tokens", "mean_sqrt_len_tokens"])
def test_a_sentence_is_the_same_alone_and_packed_beside_others(minilm_checkpoint, tmp_path, pooling):
    # Each input attends to itself only and pools over its own tokens, whatever lies beside it.
    model_dir = _with_pooling(minilm_checkpoint, tmp_path, pooling)
    model = load_bert_encoder(model_dir)
    short, long = [101, 7592, 102], [101] + [2088, 7592] * 15 + [102]
    alone = model(PackedBatch.build([short], "cpu"))
    beside = model(PackedBatch.build([long, short, long[:7]], "cpu"))
    # (Unnormalised values up to ~5: the projections' float32 sums may round differently per batch size.)
    torch.testing.assert_close(alone[0], beside[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model(PackedBatch.build([long], "cpu"))[0], beside[0], atol=1e-5, rtol=1e-5)


def test_tokenize_gives_the_ids_of_the_tokenizer_itself_without_its_file_padding_or_truncation(minilm_checkpoint):
    # The checkpoint's tokenizer.json pads and truncates to 128: the engine's batch encoder must do
    # neither, and must normalise as the transformers tokenizer does.
    engine = EmbeddingEngine(minilm_checkpoint)
    try:
        texts = [
            *SENTENCES,
            "",
            "Ünïcödé Straße façade naïve",
            "日本語のテキスト",
            "  tabs\tand\nnewlines  ",
            "ÀÉÎÕÜ mixed CASE",
            "word " * 200,
        ]
        ids = engine.tokenize(texts)
        assert ids == engine.tokenizer(texts, add_special_tokens=True)["input_ids"]
        assert len(ids[-1]) == 202 and len(ids[3 + len(SENTENCES)]) < 128  # not truncated, not padded
        with pytest.raises(ValueError, match="has 602 tokens"):
            engine.tokenize(["word " * 600])
    finally:
        engine.shutdown()
