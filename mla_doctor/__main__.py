from mla_doctor.cli import main

main()
