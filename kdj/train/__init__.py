"""DFlash drafter training: data (ShareGPT prompts, target-regenerated responses), the
many-blocks training forward, the training loop, and acceptance evaluation.

    kdj train-drafter --config configs/train/smollm2-b16.yaml
    kdj train-drafter --config configs/train/smollm2-b16-continue.yaml   # from the shipped one
    kdj eval-acceptance --target smollm2-135m-instruct --drafter out/.../drafter
"""
