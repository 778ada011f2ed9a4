"""Several models in one server, as Ollama and llama.cpp's router mode serve them: each model runs in a child
process that is today's one-model server (entrypoints/model_process.py), started on the first request that names
it and stopped once idle for its keep_alive or to make room; this process answers the model-free endpoints and
forwards every other request to the child of the model it names."""
