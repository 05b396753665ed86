"""Two ranks with HSDP_TRACE set (tests/test_multirank.py): each writes its own file at exit."""

import hsdp
from hsdp import models

model = models.make_model("tiny", seed=0)
hsdp.apply_hsdp_to_model(model, hsdp.HSDPInferenceConfig(enabled=True))
x = models.make_inputs(model.config, seed=0)
model(*x)
model(*x)
