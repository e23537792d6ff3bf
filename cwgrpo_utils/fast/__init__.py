"""Section 3's fast paths, which cwgrpo.py calls behind one visible branch each: each group's
prompt encoded once (shared_prompt.py) and the LM head a chunk of positions at a time
(lm_head.py); the same values to rounding."""
