"""Site-side internals of the ClientApp: data, partitions and models.

``clients.datasets`` (built-in datasets and a user's ``.npz`` files), ``clients.partitioning``
(IID and Dirichlet splits), ``clients.site_files`` (one file per site for deployments) and
``clients.models`` (the MLP and CNN). Import from the submodules: nothing is re-exported here,
so that reading data never imports torch.
"""
