"""A training run's machinery around cwgrpo.py's loop: the run itself (run.py: Run), its folder
with its lock, stop signals and records (folder.py), checkpoints, the metrics a step records
(metrics.py), the trackers, and the pictures it draws (plots.py, token_page.py)."""
