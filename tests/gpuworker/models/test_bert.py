"""The BERT encoder against transformers' BertModel with sentence-transformers' head (mean pooling,
then normalise) on the real all-MiniLM-L6-v2, and the engine's padding-aware buckets."""

import asyncio
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, BertModel

from gpuworker.engine.embedding_engine import EmbeddingEngine, buckets
from gpuworker.models.bert import SentenceHead, load_bert_encoder

SENTENCES = ["What is the capital of France?", "a", "Embeddings map text to vectors; " * 12,
             "The quick brown fox jumps over the lazy dog.", "GPU inference, self-hosted."]


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
    for item in minilm_checkpoint.iterdir():
        (tmp_path / item.name).symlink_to(item)
    (tmp_path / "1_Pooling").unlink()
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 384, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    (tmp_path / "modules.json").unlink()
    modules = json.loads((minilm_checkpoint / "modules.json").read_text())[:2]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    model = load_bert_encoder(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    batch = tokenizer(SENTENCES[:2], padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = BertModel.from_pretrained(tmp_path).eval()(**batch).last_hidden_state[:, 0]
    torch.testing.assert_close(model(batch["input_ids"], batch["attention_mask"]), expected, atol=1e-5, rtol=1e-4)


def test_unsupported_checkpoints_are_refused_clearly(minilm_checkpoint, tmp_path):
    for item in minilm_checkpoint.iterdir():
        (tmp_path / item.name).symlink_to(item)
    config = json.loads((minilm_checkpoint / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**config, "position_embedding_type": "relative_key"}))
    with pytest.raises(ValueError, match="position_embedding_type"):
        load_bert_encoder(tmp_path)


def test_buckets_keep_similar_lengths_together_within_the_token_budget():
    lengths = [3, 100, 4, 120, 5, 6, 90]
    groups = buckets(lengths, max_batch_tokens=250)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        sizes = [lengths[i] for i in group]
        assert max(sizes) <= 2 * min(sizes)
        assert len(group) * max(sizes) <= 250 or len(group) == 1
    assert [sorted(lengths[i] for i in g) for g in groups] == [[3, 4, 5, 6], [90, 100], [120]]


def test_too_long_or_bad_token_ids_are_value_errors(minilm_checkpoint):
    engine = EmbeddingEngine(minilm_checkpoint)
    try:
        with pytest.raises(ValueError, match="at most 256"):
            engine.check([[101] * 257])
        with pytest.raises(ValueError, match="outside"):
            engine.check([[101, 10 ** 6]])
    finally:
        engine.shutdown()


def test_batches_are_padded_to_a_multiple_of_8_within_the_position_limit(minilm_checkpoint):
    engine = EmbeddingEngine(minilm_checkpoint)
    try:
        input_ids, mask = engine._padded([[101, 7592, 102], [101] + [2088] * 9 + [102]])
        assert input_ids.shape == mask.shape == (2, 16)
        assert mask.sum(dim=1).tolist() == [3, 11]
        limit = engine.model.config.max_position_embeddings
        input_ids, mask = engine._padded([[101] * (limit - 2)])
        assert input_ids.shape == (1, limit)  # 510 -> 512, the model's last position
        # Padding changes no vector: a sentence alone equals itself beside a longer one.
        alone = engine.model(*engine._padded([[101, 7592, 102]]))
        beside = engine.model(*engine._padded([[101, 7592, 102], [101] + [2088] * 30 + [102]]))
        assert torch.allclose(alone[0], beside[0], atol=1e-6)
    finally:
        engine.shutdown()


def test_tokenize_gives_the_ids_of_the_tokenizer_itself_without_its_file_padding_or_truncation(minilm_checkpoint):
    # The checkpoint's tokenizer.json pads and truncates to 128: the engine's batch encoder must do
    # neither, and must normalise as the transformers tokenizer does.
    engine = EmbeddingEngine(minilm_checkpoint)
    try:
        texts = [*SENTENCES, "", "Ünïcödé Straße façade naïve", "日本語のテキスト", "  tabs\tand\nnewlines  ",
                 "ÀÉÎÕÜ mixed CASE", "word " * 200]
        ids = engine.tokenize(texts)
        assert ids == engine.tokenizer(texts, add_special_tokens=True)["input_ids"]
        assert len(ids[-1]) == 202 and len(ids[3 + len(SENTENCES)]) < 128  # not truncated, not padded
        with pytest.raises(ValueError, match="has 602 tokens"):
            engine.tokenize(["word " * 600])
    finally:
        engine.shutdown()
