"""The LoRA projection groups: projections that share an input are fused into one weight,
and their adapters are applied in one kernel launch per group."""

QKV, OUT, GATE_UP, DOWN = range(4)
LORA_GROUPS = {  # group -> its targets in the order their outputs sit in the fused weight
    QKV: ("q_proj", "k_proj", "v_proj"),
    OUT: ("o_proj",),
    GATE_UP: ("gate_proj", "up_proj"),
    DOWN: ("down_proj",),
}
