"""The quality gate: its policy (`policy.py`: the rungs, the signals, accept or fall back) and its ladder
for one prompt (`ladder.py`: every rung a direct handoff at its ρ). It sits above the handoff, which it
runs rung by rung; of the runtime path only `conversation.py` imports it."""
