"""How long a training iteration of a layout takes, estimated before anything runs, for `mimo plan --suggest`:
the provider's FLOPs per module priced with measured efficiencies and per-layout overheads (model.py), the rates
fitted to measured runs (calibration.json, calibration.py, fit.py), a plan's modules and batch (workload.py), and
the ranking of the layouts that fit memory (advisor.py)."""
