"""Settings of the Llama pair that faults are injected into: the real-engine chaos tests
(tests/chaos/test_real_engines.py) and ``bench faults`` run the same engines and deadlines."""

from __future__ import annotations

# Every fault ends requests within seconds: once its engine stops signalling layers, prefill's
# sends expire 6 s after their last progress; a silent peer is lost after 2 s.
SIDECAR_ENV = {
    "KVSIDECAR_SEND_TIMEOUT_S": "6",
    "KVSIDECAR_ACK_TIMEOUT_S": "2",
    "KVSIDECAR_HANDSHAKE_TIMEOUT_S": "3",
    "KVSIDECAR_HEARTBEAT_INTERVAL_S": "0.5",
    "KVSIDECAR_LEASE_S": "2",
}
# 1024 blocks of 128 tokens (256 MiB of KV: copied whole before each scenario); 256 tokens per
# step, so a long prompt takes several steps and a fault can fall between its layers. float32:
# decode recomputes a failed load in whatever batch it has, and in bfloat16 a batch's rounding
# flips a near-tied greedy token of the random model often enough to fail one of 64 prompts
# now and then (CI stop 41: a recomputed prompt, its whole prompt computed by decode, second
# token off); in float32 such ties are about a thousand times rarer.
VLLM_ARGS = (
    "--num-gpu-blocks-override",
    "1024",
    "--max-num-batched-tokens",
    "256",
    "--dtype",
    "float32",
)
# Decode gives up on a transfer after this and recomputes: no fault waits longer.
RECV_TIMEOUT_S = 10.0
