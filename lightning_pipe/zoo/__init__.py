"""The demo models and data modules the Hydra command line and the recipes train.

They are not the library: the strategy takes any LightningModule. They ship inside the package
(rather than in an ``examples/`` folder) because ``lightning-pipe-train`` and the recipes instantiate
them by import path from an installed package: the torchvision VGGs and ResNets flattened into
chains (:mod:`.models`), the image classifier around them (:mod:`.classifier`) and the data modules
for scikit-learn's digits, CIFAR-10, ImageNet and synthetic images (:mod:`.data`).
"""
