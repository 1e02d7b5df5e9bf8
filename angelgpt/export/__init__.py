"""After training: export a checkpoint to Hugging Face transformers, generate from it, evaluate it.

    angelgpt export --load runs/ck --output runs/hf          # export.py (GPT-2: gpt2.py, Llama: llama.py)
    angelgpt generate --load runs/ck --prompt "ROMEO:"       # generate.py (checkpoint or runs/hf)
    angelgpt eval --load runs/ck --json                      # evaluate.py

Every command reads a checkpoint through checkpoint_reader.py (one tensor at a time, any TP/PP/DP
layout, either optimizer, no process group); generate and eval build angelgpt's own GPT in one process
with local_model.py. Needs the `export` extra (transformers, safetensors): `pip install -e ".[export]"`.
"""

import warnings
from contextlib import contextmanager


@contextmanager
def quiet():
    """Megatron's and transformers' import-time and loading chatter off (warnings, progress bars, info
    logs) for the duration."""
    with warnings.catch_warnings():
        for category in (UserWarning, FutureWarning, DeprecationWarning):
            warnings.simplefilter("ignore", category)
        try:
            from transformers.utils import logging as hf_logging
        except ImportError:
            hf_logging = None
        if hf_logging is not None:
            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()
        try:
            yield
        finally:
            if hf_logging is not None:
                hf_logging.set_verbosity(verbosity)
                hf_logging.enable_progress_bar()
