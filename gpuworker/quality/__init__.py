"""Quality checks of a model as the engine runs it: perplexity on the project's fixed evaluation
text (eval_text.txt; its source and licence in README.md), for quantized models against their base."""
