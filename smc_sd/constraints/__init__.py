"""What a target multiplies into p_T: boolean constraints and positive potentials.

A constraint phi(x) in {0, 1} is written as a `Language` (`languages`: a regex, a Lark grammar
or a JSON schema), a genlm-control Potential (`grammars`) or a `TokenConstraint`
(`token_constraints`); the compiler lowers each to batched next-token masks (llguidance where
it can: `llguidance_masks`, `compiled_grammars`). A positive potential phi(x) > 0 is scored at
block ends on whole prefixes (`scores`, `potentials`).

The package depends on no other part of smc_sd but the backends' vocabularies: the program
names these objects, the compiler lowers them and the engine asks their masks.
"""
