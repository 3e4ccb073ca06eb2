"""DeepInfer backend for Huawei Ascend NPUs.  Importing this package does not import torch_npu."""
