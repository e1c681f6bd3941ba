"""Small helpers every app shares (not an app: no models), as the HackSoft styleguide's `common`."""
