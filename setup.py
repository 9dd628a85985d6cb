from setuptools import find_packages, setup

setup(
    name="hpcdl",
    version="0.1.0",
    description="Data-parallel training of image classifiers on CPU supercomputers run by Slurm",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["hpcdl", "hpcdl.*"]),
    # the native pieces' sources, built by hpcdl.distributed.native.build (hpcdl ccl install, or a rank's first use)
    package_data={"hpcdl.distributed.native": ["c_comm_thread.c", "ccl_backend.cpp"]},
    install_requires=[
        "torch>=2.4",
        "torchvision>=0.19",
        "h5py>=3.8",
        "submitit>=1.5",
        "numpy>=1.24",
        "pillow>=10.0",
        "pyyaml>=6.0",  # config files
        "tqdm>=4.60",  # the progress bar
        "tensorboard>=2.10",  # torch.utils.tensorboard writes the scalars
        "schedulefree>=1.4",  # optimizer.name=schedulefree, schedulefree_sgd (pure Python, Meta's package)
    ],
    extras_require={
        "mpi": ["mpi4py>=3.1"],
        "plot": ["matplotlib>=3.7"],  # hpcdl timeline render
        "timm": ["timm>=1.0", "safetensors>=0.4"],  # model=timm:NAME; weights files in safetensors
        # IPEX is archived; its last release, 2.8, needs torch 2.8.* exactly.
        "ipex": ["intel-extension-for-pytorch==2.8.*", "torch==2.8.*"],
        # sklearn: the digits (bench large-batch, docs/data.md); Lightning: its DDP on hpcdl's groups
        # (tests/test_plugin.py); simplejpeg: a third JPEG decoder for bench data; pytest-xdist: make test's workers
        "dev": ["pytest>=7", "pytest-timeout>=2.1", "pytest-xdist>=3.5", "filelock>=3", "scikit-learn>=1.2", "pytorch-lightning>=2.6", "simplejpeg>=1.6"],
    },
    entry_points={
        "console_scripts": ["hpcdl = hpcdl.cli:console"],
        # torch.distributed finds these by name: init_process_group("oneccl") with no import of hpcdl
        "torch.distributed.backends": ["oneccl = hpcdl.distributed.group.plugin:oneccl",
                                       "mpi4py = hpcdl.distributed.group.plugin:mpi4py"],
    },
)
