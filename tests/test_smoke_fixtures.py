from lorapipe.stages.encoded import EncodedData


def test_encoded_fixture_has_train_and_holdout_samples(encoded):
    data = EncodedData(encoded.artifact_dir, encoded.cache_root)
    assert len(data.split("train")) == 6 and len(data.split("holdout")) == 2
    mean, std = data.latent(data.split("train")[0])
    assert mean.shape == (4, 8, 8) and (std > 0).all()
