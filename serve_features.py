"""Serve target features from vLLM for ``features=vllm_server`` runs:
``python serve_features.py <the run's overrides> features=vllm_server features.serve.port=8100``
(see README)."""

import hydra
from omegaconf import DictConfig

import dflash_lit.resolvers  # noqa: F401  (registers ${repo_root:})
from dflash_lit.cli import entry_point


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
@entry_point
def main(cfg: DictConfig) -> None:
    from dflash_lit.train.feature_servers import serve

    raise SystemExit(serve(cfg))


if __name__ == "__main__":
    main()
