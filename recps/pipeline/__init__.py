"""The recommendation funnel (issue 16): recall -> coarse rank -> fine rank -> fusion on one PS layer, a mode per stage."""
