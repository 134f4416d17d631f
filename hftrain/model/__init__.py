"""The model: presets and configs -> transformers' GPTNeoXForCausalLM, the tokenizer, fine-tuning methods (peft,
bitsandbytes), the loss, and sampling. Never a re-implementation of the architecture."""
