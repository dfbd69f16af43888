//! The broker's keys: one master key from the daemon's config or environment, and what is
//! derived from it (the key that seals secret values, and each sandbox's CA key). Nothing
//! derived is ever stored, so a sandbox's CA survives daemon restarts and hibernation
//! without its private key being written anywhere.

use super::BrokerError;
use aws_lc_rs::aead::{AES_256_GCM, Aad, NONCE_LEN, Nonce, RandomizedNonceKey};
use aws_lc_rs::hkdf;
use zeroize::Zeroizing;

/// Environment variable holding the master key (64 hex digits or base64 of 32 bytes).
pub const KEY_ENV: &str = "SANDPIT_BROKER_KEY";

/// Labels of the derived keys; changing one makes every stored secret unreadable.
const SEAL_INFO: &[u8] = b"sandpit broker: secret sealing v1";
const CA_INFO: &[u8] = b"sandpit broker: sandbox ca v1:";

/// Length of an HKDF output, as aws-lc-rs asks for it.
struct Len(usize);

impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

/// The master key and the sealing key derived from it.
pub struct Keys {
    prk: hkdf::Prk,
    seal: RandomizedNonceKey,
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Keys(..)")
    }
}

/// Reads 32 key bytes from text (hex or base64) or, for a file (`raw_ok`), also as raw
/// bytes. Raw means binary: 32 printable characters are a mistyped text key, not a key.
pub fn parse_key(bytes: &[u8], raw_ok: bool) -> Result<Zeroizing<Vec<u8>>, BrokerError> {
    use base64::Engine;
    let bad = || {
        BrokerError::Key(
            "the broker key must be 32 bytes: 64 hex digits, base64, or a 32-byte file".into(),
        )
    };
    if let Ok(text) = std::str::from_utf8(bytes) {
        let text = text.trim();
        if let Ok(k) = hex::decode(text)
            && k.len() == 32
        {
            return Ok(Zeroizing::new(k));
        }
        for engine in [
            base64::engine::general_purpose::STANDARD,
            base64::engine::general_purpose::URL_SAFE,
        ] {
            if let Ok(k) = engine.decode(text)
                && k.len() == 32
            {
                return Ok(Zeroizing::new(k));
            }
        }
    }
    let text_like = bytes
        .iter()
        .all(|b| b.is_ascii_graphic() || b.is_ascii_whitespace());
    if raw_ok && bytes.len() == 32 && !text_like {
        return Ok(Zeroizing::new(bytes.to_vec()));
    }
    Err(bad())
}

impl Keys {
    /// Derives the broker's keys from a 32-byte master key.
    pub fn new(master: &[u8]) -> Result<Self, BrokerError> {
        if master.len() != 32 {
            return Err(BrokerError::Key("the broker key must be 32 bytes".into()));
        }
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, b"sandpit-broker").extract(master);
        let mut seal_key = Zeroizing::new([0u8; 32]);
        prk.expand(&[SEAL_INFO], Len(32))
            .and_then(|okm| okm.fill(&mut seal_key[..]))
            .map_err(|_| BrokerError::Key("deriving the sealing key failed".into()))?;
        let seal = RandomizedNonceKey::new(&AES_256_GCM, &seal_key[..])
            .map_err(|_| BrokerError::Key("the sealing key was refused".into()))?;
        Ok(Self { prk, seal })
    }

    /// Encrypts `value`, bound to `label` (owner and name): a sealed value moved to
    /// another secret's row does not open. The result is nonce, ciphertext and tag.
    pub fn seal(&self, label: &str, value: &[u8]) -> Result<Vec<u8>, BrokerError> {
        let mut buf = value.to_vec();
        let nonce = self
            .seal
            .seal_in_place_append_tag(Aad::from(label.as_bytes()), &mut buf)
            .map_err(|_| BrokerError::Crypto("sealing failed"))?;
        let mut out = Vec::with_capacity(NONCE_LEN + buf.len());
        out.extend_from_slice(nonce.as_ref());
        out.extend_from_slice(&buf);
        zeroize::Zeroize::zeroize(&mut buf);
        Ok(out)
    }

    /// Decrypts what [`Self::seal`] made for `label`.
    pub fn open(&self, label: &str, sealed: &[u8]) -> Result<Zeroizing<Vec<u8>>, BrokerError> {
        if sealed.len() < NONCE_LEN {
            return Err(BrokerError::Crypto("sealed value too short"));
        }
        let (nonce, ct) = sealed.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce)
            .map_err(|_| BrokerError::Crypto("bad nonce"))?;
        let mut buf = Zeroizing::new(ct.to_vec());
        let n = self
            .seal
            .open_in_place(nonce, Aad::from(label.as_bytes()), &mut buf)
            .map_err(|_| {
                BrokerError::Crypto("the secret cannot be decrypted with the configured key")
            })?
            .len();
        buf.truncate(n);
        Ok(buf)
    }

    /// A P-256 private key for sandbox `id`'s CA, as PKCS#8 DER: the same for the same
    /// master key and id, unrelated across ids.
    pub fn sandbox_ca_key(&self, id: &str) -> Result<Zeroizing<Vec<u8>>, BrokerError> {
        use aws_lc_rs::signature::{ECDSA_P256_SHA256_ASN1_SIGNING, EcdsaKeyPair};
        // A scalar of zero or beyond the group order (odds about 2^-32) is rejected; the
        // counter then picks the next candidate.
        for counter in 0u8..=255 {
            let mut scalar = Zeroizing::new([0u8; 32]);
            let info = [CA_INFO, id.as_bytes(), &[counter]];
            self.prk
                .expand(&info, Len(32))
                .and_then(|okm| okm.fill(&mut scalar[..]))
                .map_err(|_| BrokerError::Crypto("deriving a CA key failed"))?;
            let der = ec_private_key_der(&scalar);
            if let Ok(pair) =
                EcdsaKeyPair::from_private_key_der(&ECDSA_P256_SHA256_ASN1_SIGNING, &der)
            {
                let pkcs8 = pair
                    .to_pkcs8v1()
                    .map_err(|_| BrokerError::Crypto("encoding a CA key failed"))?;
                return Ok(Zeroizing::new(pkcs8.as_ref().to_vec()));
            }
        }
        Err(BrokerError::Crypto("no usable CA key could be derived"))
    }
}

/// RFC 5915 ECPrivateKey of a P-256 scalar, without the optional public key (aws-lc
/// computes it): SEQUENCE { 1, OCTET STRING scalar, [0] prime256v1 }.
fn ec_private_key_der(scalar: &[u8; 32]) -> Zeroizing<Vec<u8>> {
    const PRIME256V1: [u8; 10] = [0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07];
    let mut der = Zeroizing::new(Vec::with_capacity(51));
    der.extend_from_slice(&[0x30, 0x31, 0x02, 0x01, 0x01, 0x04, 0x20]);
    der.extend_from_slice(scalar);
    der.extend_from_slice(&[0xa0, 0x0a]);
    der.extend_from_slice(&PRIME256V1);
    der
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(b: u8) -> Keys {
        Keys::new(&[b; 32]).unwrap()
    }

    #[test]
    fn keys_parse_from_hex_base64_and_raw_bytes() {
        let raw = [7u8; 32];
        assert_eq!(
            &*parse_key(hex::encode(raw).as_bytes(), false).unwrap(),
            &raw
        );
        let b64 = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, raw);
        assert_eq!(
            &*parse_key(format!("{b64}\n").as_bytes(), false).unwrap(),
            &raw
        );
        assert_eq!(&*parse_key(&raw, true).unwrap(), &raw);
        assert!(parse_key(&raw, false).is_err());
        assert!(parse_key(b"too short", true).is_err());
        // 32 hex digits are a 16-byte key typed as text, not 32 raw bytes.
        assert!(parse_key(hex::encode([1u8; 16]).as_bytes(), true).is_err());
    }

    #[test]
    fn sealed_values_open_only_with_their_key_and_label() {
        let k = keys(1);
        let sealed = k.seal("a/gh", b"hunter2").unwrap();
        assert!(!sealed.windows(7).any(|w| w == b"hunter2"));
        assert_eq!(&*k.open("a/gh", &sealed).unwrap(), b"hunter2");
        assert!(k.open("b/gh", &sealed).is_err());
        assert!(keys(2).open("a/gh", &sealed).is_err());
        let mut flipped = sealed.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert!(k.open("a/gh", &flipped).is_err());
        assert!(k.open("a/gh", &sealed[..5]).is_err());
        // A fresh nonce each time.
        assert_ne!(sealed, k.seal("a/gh", b"hunter2").unwrap());
    }

    #[test]
    fn ca_keys_are_stable_per_sandbox_and_distinct_across() {
        let k = keys(3);
        let a1 = k.sandbox_ca_key("sbx-a").unwrap();
        let a2 = k.sandbox_ca_key("sbx-a").unwrap();
        let b = k.sandbox_ca_key("sbx-b").unwrap();
        assert_eq!(*a1, *a2);
        assert_ne!(*a1, *b);
        assert_ne!(*a1, *keys(4).sandbox_ca_key("sbx-a").unwrap());
        let pair = rcgen::KeyPair::from_pkcs8_der_and_sign_algo(
            &rustls_pki_types::PrivatePkcs8KeyDer::from(a1.as_slice()),
            &rcgen::PKCS_ECDSA_P256_SHA256,
        );
        assert!(pair.is_ok());
    }
}
