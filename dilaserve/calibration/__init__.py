"""Per-model calibration: a model's control inputs (latency profile at every TP degree, step
predictor) measured on one device and dtype, stored under a key that names them, and found
again by `serve`. `store.py` holds the key, the folders and the lookup (no torch); `run.py` the
`calibrate` and `profile` commands; `latency.py` the measurement through the cluster's workers.
"""
