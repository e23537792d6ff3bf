"""Models and what they read: loading models, tokenizers and data with one-line failures
(loading.py), LoRA (lora.py), the CPU presets' models and tasks built on first use (tiny.py,
smollm2.py, preset_models.py; their configs in model_configs/), the prompts a run trains on
(prompts.py), and a batch's rows (batch.py)."""
