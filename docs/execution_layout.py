"""Draws docs/execution_layout.png: how commands travel from the control plane and the trainer's
caller to the devices (python docs/execution_layout.py)."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

BOXES = {  # name: (x, y, w, h, text, colour)
    "runtime": (0.5, 8.6, 4.2, 0.9, "Runtime (control plane, process 0)", "#dde7f5"),
    "backend": (0.5, 7.0, 4.2, 0.9, "EngineBackend\nplacement: peer / handoff / ticket", "#dde7f5"),
    "commands": (
        5.4,
        7.0,
        3.6,
        2.5,
        "execution/commands.py\nLoad  OfferParams  Submit\n"
        "SendRequests  ReceiveRequests\nInterrupt  Extend  End  Step\nPause  Resume  "
        "Snapshot  Restore\n---\nStartTrainer  TrainStep\nExportParams  GatherState\n"
        "RestoreState",
        "#fff4d6",
    ),
    "inline": (0.0, 5.2, 1.9, 0.9, "Inline\n(logical)", "#e6f2e6"),
    "threaded": (2.1, 5.2, 1.9, 0.9, "Threaded\n(wall)", "#e6f2e6"),
    "remote": (4.2, 5.2, 2.4, 0.9, "RemoteTransport\n(other process)", "#e6f2e6"),
    "host": (4.2, 3.6, 2.4, 0.9, "GroupHost -> its\nInline / Threaded", "#e6f2e6"),
    "gworker": (0.5, 2.0, 5.2, 0.9, "GroupWorker.apply(command) -> Engine", "#f6e0e0"),
    "grpo": (9.6, 8.6, 3.4, 0.9, "GRPOTrainer (process 0)", "#dde7f5"),
    "spmd": (9.6, 7.0, 3.4, 0.9, "SpmdTrainer\nbroadcast, then run here", "#e6f2e6"),
    "follow": (11.2, 5.2, 2.6, 0.9, "FollowTrainer\n(other processes)", "#e6f2e6"),
    "tworker": (
        8.4,
        2.0,
        5.4,
        0.9,
        "TrainerWorker.apply(command) -> Trainer\n(every trainer process, same executable)",
        "#f6e0e0",
    ),
}
ARROWS = [
    ("runtime", "backend"),
    ("backend", "inline"),
    ("backend", "threaded"),
    ("backend", "remote"),
    ("remote", "host"),
    ("inline", "gworker"),
    ("threaded", "gworker"),
    ("host", "gworker"),
    ("grpo", "spmd"),
    ("spmd", "follow"),
    ("spmd", "tworker"),
    ("follow", "tworker"),
]


def centre(b, side):
    x, y, w, h = BOXES[b][:4]
    return (x + w / 2, y) if side == "bottom" else (x + w / 2, y + h)


def main() -> None:
    fig, ax = plt.subplots(figsize=(12, 7.2))
    for x, y, w, h, text, colour in BOXES.values():
        ax.add_patch(
            FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", fc=colour, ec="#444444")
        )
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8.5)
    for a, b in ARROWS:
        ax.add_patch(
            FancyArrowPatch(
                centre(a, "bottom"),
                centre(b, "top"),
                arrowstyle="-|>",
                mutation_scale=12,
                color="#333333",
            )
        )
    ax.text(
        0.0,
        4.4,
        "transports: move commands, return futures,\nknow nothing of their meaning",
        fontsize=8,
        style="italic",
        color="#555555",
    )
    ax.text(
        8.4,
        4.4,
        "the trainer is one program: every command\nreaches every trainer process",
        fontsize=8,
        style="italic",
        color="#555555",
    )
    ax.text(
        5.4,
        6.5,
        "one vocabulary; one record codec\nfor messages and checkpoints",
        fontsize=8,
        style="italic",
        color="#555555",
    )
    ax.set_xlim(-0.3, 14.2)
    ax.set_ylim(1.6, 9.8)
    ax.axis("off")
    ax.set_title("dora_jax execution: commands, transports, interpreters")
    out = Path(__file__).with_name("execution_layout.png")
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(out)


if __name__ == "__main__":
    main()
