"""``python -m megatron_mtraining.examples.study``: see the package's docstring."""

import logging
import warnings

# Megatron's imports (the data stage's) warn about kernels this process never runs, and
# megatron.training sets the root logger to INFO; the training processes log it all.
warnings.filterwarnings("ignore", module=r"megatron\b")
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)

from .cli import main  # noqa: E402

logging.getLogger("megatron").setLevel(logging.WARNING)
main()
