"""Benchmark file: a random Qwen3-MoE written as GGUF here (no download), for `bench latency
--compare llama.cpp` on the mixture-of-experts path. The shape is Qwen3-30B-A3B's pattern
scaled to two cores (64 experts, 8 per token, renormalised weights, q/k norms); the
vocabulary is the default model's (read by transformers from its GGUF), so both engines
tokenise the same prompt.

    python tests/bench_moe_gguf.py OUT.gguf            # F32
    then llama.cpp's quantiser for Q8_0 / Q4_K_M (docs/benchmarks.md gives the command)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gguf_export import write_gguf_from_hf  # noqa: E402


def _pre_tokenizer(path: Path) -> str:
    """The default GGUF's tokenizer.ggml.pre, which llama.cpp needs to tokenise as it does."""
    import gguf

    field = gguf.GGUFReader(str(path)).fields["tokenizer.ggml.pre"]
    return bytes(field.parts[field.data[0]]).decode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--type", default="F32", help="a type gguf-py writes: F32, F16, Q8_0, ...")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--expert-ff", type=int, default=256)
    args = parser.parse_args()

    import transformers as tf

    from nanoinfer.loaders import default_model_path

    default = default_model_path()
    tok = tf.AutoTokenizer.from_pretrained(str(default.parent), gguf_file=default.name)
    cfg = tf.Qwen3MoeConfig(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                            num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                            num_experts=args.experts, num_experts_per_tok=args.top_k,
                            moe_intermediate_size=args.expert_ff, norm_topk_prob=True, max_position_embeddings=4096,
                            rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = tf.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # a router spread wide enough that tokens pick different experts
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    write_gguf_from_hf(model, tok, args.out, args.type, name="qwen3moe-bench", tokenizer_pre=_pre_tokenizer(default))
    print(args.out)


if __name__ == "__main__":
    main()
