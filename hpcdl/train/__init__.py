"""Training. So far: checkpoints (``checkpoint``) and the choice of precision (``precision``); the training
loop, evaluation and metrics build on them."""
