"""Models: configs, the Qwen3-family decoder and checkpoint I/O.

```python
from sparrow_jax.models import load_pretrained
model = load_pretrained("path/to/hf_dir_or_file.gguf", dtype="float32")
logits = model(tokens)  # int32 [batch, seq] -> float32 [batch, seq, vocab]
```
"""

from sparrow_jax.models.checkpoints import (checkpoint_config, load_pretrained, load_tokenizer,
                                           save_pretrained)
from sparrow_jax.models.config import PRESETS, ModelConfig, from_hf_config, get_config
from sparrow_jax.models.decoder import Decoder, init_model

__all__ = ["checkpoint_config", "load_pretrained", "save_pretrained", "load_tokenizer",
           "ModelConfig", "PRESETS", "get_config", "from_hf_config", "Decoder", "init_model"]
