"""A tiny random Qwen3-MoE checkpoint with a local WordLevel tokenizer (~1 MB, no download)."""

from __future__ import annotations

import sys
from pathlib import Path


def build(out: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    vocab = {f"w{i}": i for i in range(1000)}
    vocab["<unk>"] = 0
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="w999",
                            bos_token="w998", pad_token="w997").save_pretrained(out)
    config = Qwen3MoeConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=2048,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, bos_token_id=998,
        eos_token_id=999, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
