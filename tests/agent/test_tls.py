"""TLS files are checked once at start: a wrong one is one line naming the option and the file."""

from __future__ import annotations

import ssl

import pytest

from agent.errors import ConfigError
from agent.tls import TlsFiles, load_client, load_server
from tests.tlscerts import make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def server(cert, key, ca=None) -> TlsFiles:
    return TlsFiles(cert, key, ca, option="--metrics-tls")


def test_a_server_with_a_client_ca_requires_client_certificates(pki):
    material = load_server(server(pki.server_cert, pki.server_key, pki.ca))
    assert material.verifies_peer
    assert material.context.verify_mode == ssl.CERT_REQUIRED
    assert material.context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert material.cert_chain == pki.server_cert.read_bytes()
    assert material.ca == pki.ca.read_bytes()
    assert not load_server(server(pki.server_cert, pki.server_key)).verifies_peer


def test_a_missing_file_names_the_option_and_the_file(pki, tmp_path):
    missing = tmp_path / "nope.pem"
    with pytest.raises(ConfigError) as err:
        load_server(server(missing, pki.server_key))
    assert str(err.value) == f"--metrics-tls-cert: cannot read {missing}: No such file or directory"


@pytest.mark.parametrize(
    ("which", "content", "expected"),
    [
        ("cert", b"hello", "--metrics-tls-cert: {path} is not a PEM file holding a certificate"),
        ("key", b"hello", "--metrics-tls-key: {path} is not a PEM file holding a private key"),
        ("ca", b"", "--metrics-tls-client-ca: {path} is not a PEM file holding CA certificates"),
    ],
)
def test_a_file_that_is_not_pem_names_the_option_and_the_file(pki, tmp_path, which, content,
                                                              expected):  # fmt: skip
    bad = tmp_path / "bad.pem"
    bad.write_bytes(content)
    files = {"cert": pki.server_cert, "key": pki.server_key, "ca": pki.ca, which: bad}
    with pytest.raises(ConfigError) as err:
        load_server(server(files["cert"], files["key"], files["ca"]))
    assert str(err.value) == expected.format(path=bad)


def test_a_key_of_another_certificate_is_refused(pki):
    with pytest.raises(ConfigError) as err:
        load_server(server(pki.server_cert, pki.client_key))
    message = str(err.value)
    assert message.startswith("--metrics-tls-cert/--metrics-tls-key: ")
    assert str(pki.server_cert) in message and str(pki.client_key) in message
    assert "the key does not belong to the certificate" in message
    assert "\n" not in message


def test_an_encrypted_key_is_refused_without_a_prompt(pki, tmp_path):
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(pki.server_key.read_bytes(), None)
    encrypted = tmp_path / "enc.pem"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    with pytest.raises(ConfigError, match=f"--metrics-tls-key: {encrypted} is encrypted"):
        load_server(server(pki.server_cert, encrypted))


def test_a_server_needs_both_certificate_and_key(pki):
    with pytest.raises(ConfigError, match="--metrics-tls-key is required"):
        load_server(server(pki.server_cert, None))


def test_a_client_needs_both_or_neither_of_certificate_and_key(pki):
    files = TlsFiles(pki.client_cert, None, pki.ca, option="--tls", ca_suffix="-ca")
    with pytest.raises(ConfigError, match="--tls-cert needs --tls-key as well"):
        load_client(files)
    material = load_client(TlsFiles(pki.client_cert, pki.client_key, pki.ca, "--tls", "-ca"))
    assert material.key == pki.client_key.read_bytes() and material.ca == pki.ca.read_bytes()
    assert load_client(TlsFiles(None, None, None, "--tls", "-ca")).cert_chain is None
