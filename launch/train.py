"""Entry point: ``python launch/train.py [--config configs/X.yaml] [--mode M] [key=value ...]``.

Only sets up the environment (8 fake CPU devices unless XLA_FLAGS says otherwise; the flag only
affects the CPU platform) and hands over to :func:`dora_jax.main.main`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, too

from dora_jax.platform import fake_cpu_devices, limit_malloc_arenas  # noqa: E402

fake_cpu_devices(8)
limit_malloc_arenas()

from dora_jax.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
