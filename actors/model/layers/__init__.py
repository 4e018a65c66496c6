"""Model layers in torch: norms, RoPE/YaRN, attention (GQA, MLA), routers, grouped experts, MoE."""
