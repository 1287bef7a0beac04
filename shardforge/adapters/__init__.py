"""Parameter-efficient fine-tuning as transforms over a built model: LoRA / DoRA / rsLoRA adapters and freeze
tuning, and the PEFT adapter format in and out."""
