import os

# Nothing in the tests may reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
