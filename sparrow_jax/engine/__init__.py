"""The generation engine: paged KV cache pool, scheduler (admission, preemption), sampling.

```python
from sparrow_jax.engine import EngineConfig, GenerationEngine, Request, SamplingParams
engine = GenerationEngine(model, EngineConfig(num_slots=64, max_seq_len=8192))
outs = engine.generate([Request(prompt_ids, SamplingParams(max_new_tokens=256))])
```
"""

from sparrow_jax.engine.engine import Completion, EngineConfig, GenerationEngine, Request
from sparrow_jax.engine.sampling import SamplingParams

__all__ = ["Completion", "EngineConfig", "GenerationEngine", "Request", "SamplingParams"]
