"""What training, evaluation and generation share below the commands: a micro-batch moved to the device
(`batch_transfer.py`), one micro-batch's forward and the provider's loss (`forward_loss.py`), megatron-core's
schedule for a layout (`schedule.py`) and the encoders run once per step (`encoder_pass.py`)."""
