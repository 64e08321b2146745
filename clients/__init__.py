"""The platform's built-in task: a Flower ClientApp like any user's, and its data and models.

``clients.client_app`` is the ClientApp (a plain ``train`` function plus
``strategies.mods.flplatform_mod``, no private path); ``clients.site`` loads what a site
holds (its data, model and device); ``clients.training`` is the training loop;
``clients.datasets`` (built-in datasets and a user's ``.npz`` files),
``clients.partitioning`` (IID and Dirichlet splits), ``clients.site_files`` (one file per
site for deployments) and ``clients.models`` (the built-in models and ``MODULE:FACTORY``).
Import from the submodules: nothing is re-exported here, so that reading data never
imports torch.
"""
