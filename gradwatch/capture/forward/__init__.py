"""The forward pass: the model's entry hooks, where a NaN is born, the modes it runs in, autocast dtypes, the data flow, eval-mode dropout."""
