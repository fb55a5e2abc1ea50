"""Generation: answers from a built model (`mimo generate`, `--eval-samples`), decoded incrementally with
megatron-core's static inference context."""
