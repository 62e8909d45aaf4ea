"""The API server process: OpenAI-compatible HTTP (protocol, serving, chat output, tool and
reasoning parsers, control routes) and the tokenizer process it starts."""
