"""The demo's model names (controlplane.demo.seed adds the models): a module without Django, so
the launcher can name them before Django is set up."""

MODEL_NAME = "demo-tiny"
# A tiny random Qwen2.5-VL (`python -m gpuworker.demo_model --vision`): takes images, answers noise.
VISION_MODEL_NAME = "demo-vision"
CHAT_MODEL_NAME = "smollm2-135m-instruct"
# SmolLM2 quantized to FP8 at load: the catalog's quality check compares it with CHAT_MODEL_NAME.
CHAT_FP8_MODEL_NAME = "smollm2-135m-instruct-fp8"
EMBEDDING_MODEL_NAME = "all-minilm-l6-v2"
