//! RFC 6962 trees and C2SP checkpoints against the public vectors, and proofs checked
//! against a direct transcription of the RFC's definitions.

use lineage_core::transparency::{
    consistency_proof, inclusion_proof, leaf_hash_of, root, verify_consistency, verify_inclusion,
    Checkpoint, Frontier, Hash, MerkleLevels, NoteSigner,
};
use lineage_core::AuditKey;
use sha2::{Digest, Sha256};

/// The RFC 6962 reference leaves (transparency-dev/merkle testonly, originally CT).
fn reference_leaves() -> Vec<Vec<u8>> {
    [
        "",
        "00",
        "10",
        "2021",
        "3031",
        "40414243",
        "5051525354555657",
        "606162636465666768696a6b6c6d6e6f",
    ]
    .iter()
    .map(|h| hex::decode(h).unwrap())
    .collect()
}

const REFERENCE_ROOTS: [&str; 9] = [
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
];

// The RFC's definitions, transcribed directly (independent of ct-merkle).
fn h(parts: &[&[u8]]) -> Hash {
    let mut hasher = Sha256::new();
    for p in parts {
        hasher.update(p);
    }
    hasher.finalize().into()
}

fn split(n: usize) -> usize {
    let mut k = 1;
    while k * 2 < n {
        k *= 2;
    }
    k
}

fn mth(d: &[Vec<u8>]) -> Hash {
    match d.len() {
        0 => h(&[]),
        1 => h(&[&[0], &d[0]]),
        n => {
            let k = split(n);
            h(&[&[1], &mth(&d[..k]), &mth(&d[k..])])
        }
    }
}

fn path(m: usize, d: &[Vec<u8>]) -> Vec<Hash> {
    if d.len() <= 1 {
        return Vec::new();
    }
    let k = split(d.len());
    if m < k {
        let mut p = path(m, &d[..k]);
        p.push(mth(&d[k..]));
        p
    } else {
        let mut p = path(m - k, &d[k..]);
        p.push(mth(&d[..k]));
        p
    }
}

fn subproof(m: usize, d: &[Vec<u8>], b: bool) -> Vec<Hash> {
    let n = d.len();
    if m == n {
        return if b { Vec::new() } else { vec![mth(d)] };
    }
    let k = split(n);
    if m <= k {
        let mut p = subproof(m, &d[..k], b);
        p.push(mth(&d[k..]));
        p
    } else {
        let mut p = subproof(m - k, &d[k..], false);
        p.push(mth(&d[..k]));
        p
    }
}

#[test]
fn reference_tree_roots() {
    let leaves = reference_leaves();
    for (size, expected) in REFERENCE_ROOTS.iter().enumerate() {
        assert_eq!(hex::encode(root(&leaves[..size])), *expected, "size {size}");
        assert_eq!(
            hex::encode(mth(&leaves[..size])),
            *expected,
            "transcription, size {size}"
        );
    }
}

#[test]
fn proofs_match_the_rfc_definitions_and_verify() {
    // The reference leaves, then deterministic 32-byte leaves up to 70.
    let mut leaves = reference_leaves();
    for i in 8..70u32 {
        leaves.push(h(&[&i.to_be_bytes()]).to_vec());
    }
    for size in 1..=leaves.len() {
        let d = &leaves[..size];
        let r = root(d);
        for index in 0..size {
            let proof = inclusion_proof(d, index as u64).unwrap();
            assert_eq!(proof, path(index, d), "inclusion {index} of {size}");
            verify_inclusion(&r, size as u64, index as u64, &d[index], &proof).unwrap();
            // Wrong leaf, wrong index, wrong root: refused.
            assert!(verify_inclusion(&r, size as u64, index as u64, b"forged", &proof).is_err());
            if size > 1 {
                let other = (index + 1) % size;
                assert!(
                    verify_inclusion(&r, size as u64, other as u64, &d[index], &proof).is_err()
                );
            }
            assert!(
                verify_inclusion(&h(&[b"x"]), size as u64, index as u64, &d[index], &proof)
                    .is_err()
            );
        }
        for old in 1..=size {
            let proof = consistency_proof(d, old as u64).unwrap();
            let expected = if old == size {
                Vec::new()
            } else {
                subproof(old, d, true)
            };
            assert_eq!(proof, expected, "consistency {old} -> {size}");
            let old_root = root(&d[..old]);
            verify_consistency(&old_root, old as u64, &r, size as u64, &proof).unwrap();
            if old < size {
                // A rewritten old tree, or a new tree that does not extend it: refused.
                assert!(
                    verify_consistency(&h(&[b"y"]), old as u64, &r, size as u64, &proof).is_err()
                );
                assert!(verify_consistency(
                    &old_root,
                    old as u64,
                    &h(&[b"z"]),
                    size as u64,
                    &proof
                )
                .is_err());
            }
        }
    }
    // Same size, another root; and proofs from the empty tree.
    let r = root(&leaves[..5]);
    assert!(verify_consistency(&r, 5, &h(&[b"other"]), 5, &[]).is_err());
    verify_consistency(&h(&[]), 0, &r, 5, &[]).unwrap();
    assert!(verify_consistency(&h(&[]), 0, &r, 5, &[r]).is_err());
    assert!(inclusion_proof(&leaves[..3], 3).is_err());
    assert!(consistency_proof(&leaves[..3], 4).is_err());
}

#[test]
fn the_c2sp_signed_note_example_verifies() {
    let vkey = "example.com/foo+530d903a+AekyeRrm56hApGFkyQR4ZCbV54Id2LKaANYcrnKv3U2k";
    let note = "This is an example message.\n\n\u{2014} example.com/foo Uw2QOkn8srV1yJGh2VYRlL1Tnagv1YEq6TfXppzi2ONncAlTgK7Ztg1ERYNZXsYjOBH3mFXmRKuwHjG1Yu72IneyaQM=\n";
    let verifier = signed_note::StandardVerifier::new(vkey).unwrap();
    let list = signed_note::VerifierList::new(vec![Box::new(verifier)]);
    let parsed = signed_note::Note::from_bytes(note.as_bytes()).unwrap();
    assert!(parsed.verify(&list).is_ok());
    assert_eq!(parsed.text(), b"This is an example message.\n");
    let edited = note.replace("example message", "examble message");
    let edited = signed_note::Note::from_bytes(edited.as_bytes()).unwrap();
    assert!(edited.verify(&list).is_err());
}

#[test]
fn checkpoints_sign_verify_and_parse_strictly() {
    let key = AuditKey::from_seed([42; 32]);
    let leaves = reference_leaves();
    let checkpoint = Checkpoint {
        origin: "lineage.example/cluster".into(),
        size: 8,
        root: root(&leaves),
    };
    assert_eq!(
        checkpoint.text(),
        "lineage.example/cluster\n8\nXcnaeacGWamtVZy3Ad7ZoqudgjqtL0lgz+Nw7/RgQyg=\n"
    );
    let note = checkpoint.sign(&key).unwrap();
    assert!(note.starts_with(&checkpoint.text()));
    assert!(note.contains("\n\n\u{2014} lineage.example/cluster "));
    let vkey = NoteSigner::new("lineage.example/cluster", &key)
        .unwrap()
        .vkey();
    assert!(vkey.starts_with("lineage.example/cluster+"));
    assert_eq!(Checkpoint::verify(&note, &vkey).unwrap(), checkpoint);

    let other = NoteSigner::new("lineage.example/cluster", &AuditKey::from_seed([7; 32]))
        .unwrap()
        .vkey();
    assert!(
        Checkpoint::verify(&note, &other).is_err(),
        "another key must not verify"
    );
    let forged = note.replacen("\n8\n", "\n9\n", 1);
    assert!(
        Checkpoint::verify(&forged, &vkey).is_err(),
        "an edited size must not verify"
    );

    for bad in [
        "",
        "origin\n",
        "origin\n08\nAAAA\n",
        "origin\n-1\nAAAA\n",
        "origin\n1\nnot base64!\n",
        "origin\n1\nAAAA\n",
    ] {
        assert!(Checkpoint::parse(bad).is_err(), "{bad:?}");
    }
    assert!(NoteSigner::new("bad name+plus", &key).is_err());
}

#[test]
fn frontier_and_levels_agree_with_the_rfc_definitions() {
    let mut leaves = reference_leaves();
    for i in 8..70u32 {
        leaves.push(h(&[&i.to_be_bytes()]).to_vec());
    }
    let mut frontier = Frontier::new();
    let mut levels = MerkleLevels::new();
    assert_eq!(hex::encode(frontier.root()), REFERENCE_ROOTS[0]);
    for (i, leaf) in leaves.iter().enumerate() {
        frontier.push(leaf);
        levels.push_leaf_hash(leaf_hash_of(leaf));
        let size = i + 1;
        assert!(frontier.is_well_formed());
        assert_eq!(frontier.size(), size as u64);
        assert_eq!(
            frontier.root(),
            mth(&leaves[..size]),
            "frontier root, size {size}"
        );
        if size < REFERENCE_ROOTS.len() {
            assert_eq!(hex::encode(frontier.root()), REFERENCE_ROOTS[size]);
        }
    }
    // Every proof for every earlier size, from the levels alone.
    for size in 0..=leaves.len() {
        let d = &leaves[..size];
        assert_eq!(
            levels.root_at(size as u64).unwrap(),
            mth(d),
            "root at {size}"
        );
        for index in 0..size {
            let proof = levels.inclusion_proof(index as u64, size as u64).unwrap();
            assert_eq!(proof, path(index, d), "inclusion {index} of {size}");
        }
        for old in 0..=size {
            let proof = levels.consistency_proof(old as u64, size as u64).unwrap();
            let expected = if old == 0 || old == size {
                Vec::new()
            } else {
                subproof(old, d, true)
            };
            assert_eq!(proof, expected, "consistency {old} -> {size}");
        }
    }
    let n = leaves.len() as u64;
    assert!(levels.inclusion_proof(n, n).is_err());
    assert!(levels.consistency_proof(3, n + 1).is_err());
    assert!(levels.root_at(n + 1).is_err());
}
