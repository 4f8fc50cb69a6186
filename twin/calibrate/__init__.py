"""Calibration: measurements in, a cost-model profile out, and the profile's predictions.

fit.py (robust fits of kernel rooflines and latency/bandwidth lines, noise), profile.py (a
``paratwin bench`` directory and interference measurements -> a CostModel profile),
predict.py (what the cost model says of a benchmarked collective or kernel, for figures).
Measuring lives in the executor (executor.bench, executor.interference); this package
never imports torch.
"""
