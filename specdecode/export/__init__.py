"""Hand-offs to other engines: files they load as they are (``vllm``)."""
